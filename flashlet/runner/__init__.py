"""The step runner: persistent input batch, forward paths, sampler."""
