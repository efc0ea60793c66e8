"""What a timing figure carries: the machine it was measured on and the load while it ran."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from iterserve.bench.machine import MachineMonitor, machine_stamp, may_draw_timing_figure, others_cpu_share


def test_the_stamp_names_the_cpu_its_cores_and_the_load_range():
    stamp = machine_stamp({"cpu": "Xeon (avx2 avx512f)", "cpu_count": 2, "load_avg": [0.12, 0.3, 0.2],
                           "busy": False, "reasons": []})
    assert stamp.startswith("Xeon (avx2 avx512f), 2 cores; load average 0.12-0.30 during the run; torch ")
    busy = MachineMonitor(probe=lambda: 0.01, loadavg=lambda: 5.0, cpu_count=2, others=lambda: 0.0)
    busy.sample()
    assert "; load average 5.00 during the run (busy: load average 5.00 on 2 cores" in machine_stamp(
        busy.check.to_dict())


def test_other_processes_busy_refuses_timing_figures_unless_allowed(capsys):
    busy = MachineMonitor(probe=lambda: 0.01, loadavg=lambda: 0.1, cpu_count=2, others=lambda: 0.6)
    busy.sample()
    machine = busy.check.to_dict()
    assert machine["refusals"] == ["other processes used 60% of the 2 cores"] and machine["busy"]
    assert not may_draw_timing_figure(machine, "the knee", allow_busy=False)
    said = capsys.readouterr().out
    assert "not drawing the knee" in said and "60% of the 2 cores" in said and "--allow-busy" in said
    assert may_draw_timing_figure(machine, "the knee", allow_busy=True)


def test_a_lagging_load_average_warns_but_does_not_refuse():
    after_a_busy_minute = MachineMonitor(probe=lambda: 0.01, loadavg=lambda: 6.0, cpu_count=2, others=lambda: 0.02)
    after_a_busy_minute.sample()
    machine = after_a_busy_minute.check.to_dict()
    assert machine["busy"] and machine["refusals"] == []
    assert may_draw_timing_figure(machine, "the knee", allow_busy=False)


def test_a_spinning_process_beside_the_benchmark_is_counted():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        share = others_cpu_share(0.5)
    finally:
        spinner.kill()
        spinner.wait()
    # one spinning process holds one core of the machine's (a share can only be higher on a busy machine)
    assert share >= 0.8 / (os.cpu_count() or 1)

