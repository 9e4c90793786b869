"""The engine core: requests, scheduler, KV block pool, detokenisation and the step loop."""
