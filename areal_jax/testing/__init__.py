"""Fixtures for tests and benchmarks: random tiny models and HF checkpoints (`models`), a tiny end-to-end
job directory and config (`tiny`), and an in-process object store for gs:// style run directories
(`fake_store`). Nothing in the library imports this package."""
