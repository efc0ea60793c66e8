"""Serving simulation: the engine's own EngineCore (scheduler, KV block manager, prefix cache, step
trace) over an executor that runs no model but moves a virtual clock by each step's duration from a
cost model (constant, roofline or calibrated), so a workload can be planned at a scale or on hardware
this machine does not have. See docs/simulation.md."""
