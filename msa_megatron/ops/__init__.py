"""Op layer: entry points, backend dispatch and autograd. Knows nothing of Megatron."""
