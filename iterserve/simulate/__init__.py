"""Serving simulation: the engine's own scheduler and KV block manager on a discrete-event clock,
each step's duration from a cost model (constant, roofline or calibrated), so a workload can be
planned at a scale or on hardware this machine does not have. See docs/simulation.md."""
