"""The trainer side: the HTTP client, trajectory adapters and trainer integrations."""
