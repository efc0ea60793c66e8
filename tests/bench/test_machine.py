"""What a timing figure carries: the machine it was measured on and the load while it ran."""

from __future__ import annotations

from iterserve.bench.machine import MachineMonitor, machine_stamp


def test_the_stamp_names_the_cpu_its_cores_and_the_load_range():
    stamp = machine_stamp({"cpu": "Xeon (avx2 avx512f)", "cpu_count": 2, "load_avg": [0.12, 0.3, 0.2],
                           "busy": False, "reasons": []})
    assert stamp.startswith("Xeon (avx2 avx512f), 2 cores; load average 0.12-0.30 during the run; torch ")
    busy = MachineMonitor(probe=lambda: 0.01, loadavg=lambda: 5.0, cpu_count=2)
    busy.sample()
    assert "; load average 5.00 during the run (busy: load average 5.00 on 2 cores" in machine_stamp(
        busy.check.to_dict())
