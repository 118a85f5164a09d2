"""The GPU's SM clock and power while steps are timed, sampled with
nvidia-smi.

MFU is model FLOPs per second over a data sheet's dense peak, and a data
sheet quotes that peak at one clock: an H100's or H200's 989.4 TFLOP/s is
132 SMs x 4096 dense bf16 FLOP per clock x 1830 MHz, an A100's 312 is
108 x 2048 x 1410 MHz (`PEAK_CLOCK_MHZ`). The chip runs at whatever clock
its power and temperature allow. On the H200 lent on 2026-11-27 (700 W
limit), GPT-2 small's timed rounds held the chip at that limit (nvidia-smi's
"SW power cap" in 40 of 41 samples) at 1635 to 1815 MHz, while short rounds
after an idle spell ran at 1980 MHz: the same step's MFU then moves with how
long the chip has been busy, not only with its kernels.

`Sampler` runs `nvidia-smi --query-gpu=... -lms PERIOD` beside the timing;
`summary` reads the samples that fall inside a step's timed rounds: the mean,
least and most SM clock, the mean power draw, and the share of samples in
which the clock was held down for power (the SW power cap or the hardware
power brake, nvidia-smi's `clocks_throttle_reasons.active` bits 0x4 and
0x80).
"""

import shutil
import subprocess
import threading
import time
from datetime import datetime

QUERY = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"
POWER_BITS = 0x4 | 0x80  # SW power cap, HW power brake slowdown
# The clock at which each data sheet's dense bf16 peak is quoted (gpt2.py's
# PEAK_BF16): peak = SMs x dense bf16 FLOP per SM per clock x this clock.
PEAK_CLOCK_MHZ = {"H100": 1830, "H200": 1830, "A100": 1410}
_STAMP = "%Y/%m/%d %H:%M:%S.%f"


def command(period_ms: int) -> list[str]:
  """nvidia-smi's command line: GPU 0's timestamp, SM clock (MHz), power
  draw (W) and clock-event bits, one line every `period_ms`."""
  return [
    "nvidia-smi",
    "-i",
    "0",
    f"--query-gpu={QUERY}",
    "--format=csv,noheader,nounits",
    "-lms",
    str(period_ms),
  ]


def available() -> bool:
  """Whether nvidia-smi is on PATH."""
  return shutil.which("nvidia-smi") is not None


def parse_line(line: str) -> dict | None:
  """One of nvidia-smi's lines (`QUERY`, no header, no units) as a sample:
  `t` (seconds since the epoch, local time as `time.time()` counts it),
  `mhz`, `watts` (None where the chip does not report it) and `bits`; None
  for a line that is not a sample (a warning, an empty line)."""
  parts = [p.strip() for p in line.split(",")]
  if len(parts) != 4:
    return None
  stamp, mhz, watts, bits = parts
  try:
    t = datetime.strptime(stamp, _STAMP).timestamp()
    mhz = int(mhz)
    bits = int(bits, 16)
  except ValueError:
    return None
  try:
    watts = float(watts)
  except ValueError:  # "[N/A]"
    watts = None
  return {"t": t, "mhz": mhz, "watts": watts, "bits": bits}


class Sampler:
  """nvidia-smi sampling in the background while the `with` block runs;
  `samples` holds what it read. `cmd` replaces nvidia-smi's command line
  (any program printing lines in its format)."""

  def __init__(self, period_ms: int = 100, cmd: list[str] | None = None):
    self.period_ms = period_ms
    self.cmd = cmd or command(period_ms)
    self.samples: list[dict] = []
    self._proc = None
    self._reader = None

  def _read(self):
    for line in self._proc.stdout:
      sample = parse_line(line)
      if sample is not None:
        self.samples.append(sample)

  def __enter__(self):
    self._proc = subprocess.Popen(
      self.cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    return self

  def __exit__(self, *exc):
    # One more period, so that the last timed round's samples are written.
    time.sleep(2 * self.period_ms / 1e3)
    self._proc.terminate()
    try:
      self._proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()
    self._reader.join(timeout=5)
    return False


def summary(samples: list[dict], windows: list[tuple[float, float]]):
  """The samples inside any of `windows` (`(start, end)` in `time.time()`
  seconds, a step's timed rounds): their count, mean, least and most SM
  clock (MHz), mean power draw (W; None where unreported) and the share held
  down for power (`POWER_BITS`). None when no sample falls inside."""
  inside = [s for s in samples if any(a <= s["t"] <= b for a, b in windows)]
  if not inside:
    return None
  mhz = [s["mhz"] for s in inside]
  watts = [s["watts"] for s in inside if s["watts"] is not None]
  capped = sum(1 for s in inside if s["bits"] & POWER_BITS)
  return {
    "samples": len(inside),
    "sm_mhz_mean": round(sum(mhz) / len(mhz), 1),
    "sm_mhz_min": min(mhz),
    "sm_mhz_max": max(mhz),
    "watts_mean": round(sum(watts) / len(watts), 1) if watts else None,
    "power_capped_share": round(capped / len(inside), 3),
  }


def peak_clock_mhz(kind: str) -> int | None:
  """The clock of `kind`'s data-sheet peak (`PEAK_CLOCK_MHZ`), or None."""
  for name, mhz in PEAK_CLOCK_MHZ.items():
    if name in kind:
      return mhz
  return None


def mfu_at_clock(mfu: float, clock: dict, peak_mhz: int) -> float:
  """`mfu` (over the data sheet's peak at `peak_mhz`) over the peak at the
  mean clock the chip ran (`summary`'s): the share of what the chip could
  do at that clock."""
  return mfu * peak_mhz / clock["sm_mhz_mean"]
