"""Everything kept in Redis: jobs, batches, the backend registry and the metrics counters."""
