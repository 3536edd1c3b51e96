"""Running a model on a device: paged KV, forward batches, CUDA graphs, row buffers."""
