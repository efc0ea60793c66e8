"""The host the engine runs on: what its CPU computes natively (:mod:`.cpu`), how much memory it has
(:mod:`.memory`), and the malloc tuning the command line applies (:mod:`.malloc`)."""
