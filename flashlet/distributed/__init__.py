"""Tensor parallelism: process group, sharding, worker ranks."""
