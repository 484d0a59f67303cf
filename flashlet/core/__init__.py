"""The engine core: Engine, Scheduler, Request and their checks."""
