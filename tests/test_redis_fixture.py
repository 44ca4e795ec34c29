def test_the_fixture_redis_refuses_to_evict(redis_client):
    assert redis_client.info("memory")["maxmemory_policy"] == "noeviction"
