"""The paged runtime (CPU/GPU exports): scheduler, coordinator, ring path, stage, KV pool and worker."""
