"""Distributed environment, device mesh, model parallelization and gradient clipping."""
