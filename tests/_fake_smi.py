"""Programs that stand in for nvidia-smi in the tests of
benchmarks/gpu_clock.py and of `gpt2.py --clocks`: they print lines in its
format (`gpu_clock.QUERY`, no header, no units), or fail as it does."""

import sys
import textwrap


def fake_smi(
  period_ms: int | None, start_mhz: int, bits: int, rise: int = 1
) -> list[str]:
  """A program that prints nvidia-smi's lines every `period_ms` (once, for
  None), after a line that is not a sample: now's local time, its SM clock
  `rise` MHz more each line from `start_mhz`, a power reading every other
  line ("[N/A]" in between, as chips that do not report it print) and
  clock-event `bits`."""
  script = textwrap.dedent(f"""
    import sys, time
    from datetime import datetime
    print("WARNING: a line that is not a sample", flush=True)
    i = 0
    while True:
        now = datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        watts = f"{{600 + i}}.50" if i % 2 == 0 else "[N/A]"
        print(f"{{now}}, {{{start_mhz} + {rise} * i}}, {{watts}}, 0x{bits:016x}", flush=True)
        if {period_ms is None}:
            break
        i += 1
        time.sleep({period_ms!r} / 1000)
    """)
  return [sys.executable, "-c", script]


def failing_smi() -> list[str]:
  """A program that fails as nvidia-smi does without its driver."""
  script = "print('Failed to initialize NVML: Driver Not Loaded'); exit(9)"
  return [sys.executable, "-c", script]
