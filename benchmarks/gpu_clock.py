"""The GPU's SM clock and power while steps are timed, sampled with
nvidia-smi.

MFU is model FLOPs per second over a data sheet's dense peak, and a data
sheet quotes that peak at one clock: an H100's or H200's 989.4 TFLOP/s is
132 SMs x 4096 dense bf16 FLOP per clock x 1830 MHz, an A100's 312 is
108 x 2048 x 1410 MHz (`PEAK_CLOCK_MHZ`). The chip runs at whatever clock
its power and temperature allow. On the H200 lent on 2026-11-27 (700 W
limit), GPT-2 small's timed rounds held the chip at that limit (nvidia-smi's
"SW power cap" in 40 of 41 samples) at 1635 to 1785 MHz once it drew 690 W,
where warm-up and compiles ran at 1980 MHz: the same step's MFU then moves
with the power the chip may draw, not only with its kernels.

`Sampler` runs `nvidia-smi --query-gpu=... -lms PERIOD` beside the timing;
`summary` reads the samples that fall inside a step's timed rounds: the mean,
least and most SM clock, the mean power draw (nvidia-smi's `power.draw`, on
Hopper an average over about a second, so it lags a round's start), and the
share of samples in which the clock was held down for power (the SW power
cap or the hardware power brake, nvidia-smi's `clocks_throttle_reasons.active`
bits 0x4 and 0x80). nvidia-smi's GPU 0 is the machine's first by PCI order,
not necessarily JAX's first device under `CUDA_VISIBLE_DEVICES`: the lent
machines have one.
"""

import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime

QUERY = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"
POWER_BITS = 0x4 | 0x80  # SW power cap, HW power brake slowdown
# The clock at which each data sheet's dense bf16 peak is quoted (gpt2.py's
# PEAK_BF16): peak = SMs x dense bf16 FLOP per SM per clock x this clock.
PEAK_CLOCK_MHZ = {"H100": 1830, "H200": 1830, "A100": 1410}
_STAMP = "%Y/%m/%d %H:%M:%S.%f"


def command(period_ms: int | None) -> list[str]:
  """nvidia-smi's command line: GPU 0's timestamp, SM clock (MHz), power
  draw (W) and clock-event bits, one line every `period_ms` (once for
  None)."""
  cmd = ["nvidia-smi", "-i", "0", f"--query-gpu={QUERY}"]
  cmd.append("--format=csv,noheader,nounits")
  return cmd + (["-lms", str(period_ms)] if period_ms else [])


def check() -> dict:
  """One sample read now, before any work: a query nvidia-smi refuses (an
  unknown field, no driver) raises here with what it printed, not after a
  run's timing as rows without a clock."""
  try:
    run = subprocess.run(
      command(None), capture_output=True, text=True, timeout=30
    )
  except (OSError, subprocess.TimeoutExpired) as e:
    raise RuntimeError(f"nvidia-smi did not answer: {e}") from e
  samples = [x for x in map(parse_line, run.stdout.splitlines()) if x]
  if run.returncode or not samples:
    said = (run.stdout + run.stderr).strip()[-500:]
    raise RuntimeError(
      f"nvidia-smi gave no sample (exit {run.returncode}): {said!r}"
    )
  return samples[0]


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
  `samples` holds what it read, `other` the lines that were not samples.
  Entering waits for the first sample (`first_within` seconds at most), so
  that the program's start-up is not in the first timed round and a program
  that prints no sample while it runs (an error, output held in a buffer)
  fails before the timing. `cmd` replaces nvidia-smi's command line (any
  program printing lines in its format)."""

  def __init__(
    self,
    period_ms: int = 100,
    cmd: list[str] | None = None,
    first_within: float = 30.0,
  ):
    self.period_ms = period_ms
    self.cmd = cmd or command(period_ms)
    self.first_within = first_within
    self.samples: list[dict] = []
    self.other: list[str] = []
    self._proc = None
    self._reader = None

  def _read(self):
    for line in self._proc.stdout:
      sample = parse_line(line)
      if sample is not None:
        self.samples.append(sample)
      elif line.strip():
        self.other.append(line.strip())

  def __enter__(self):
    self._proc = subprocess.Popen(
      self.cmd,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    deadline = time.monotonic() + self.first_within
    while not self.samples:
      stopped = self._proc.poll() is not None
      if stopped or time.monotonic() > deadline:
        self._stop()
        what = (
          f"stopped without a sample (exit {self._proc.returncode})"
          if stopped
          else f"gave no sample in {self.first_within:.0f} s"
        )
        raise RuntimeError(f"{self.cmd[0]} {what}: {self.other[-5:]!r}")
      time.sleep(0.01)
    return self

  def _stop(self):
    """The program stopped (killed if it will not stop; left behind if it
    hangs even then) and its output read to the end."""
    self._proc.terminate()
    try:
      self._proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      try:
        self._proc.wait(timeout=5)
      except subprocess.TimeoutExpired:
        pass  # hung inside the driver: left behind, not waited for forever
    self._reader.join(timeout=5)

  def __exit__(self, *exc):
    # Two more periods, so that the last timed round's samples are written.
    time.sleep(2 * self.period_ms / 1e3)
    if self._proc.poll() is not None:  # it died during the timing
      print(
        f"warning: {self.cmd[0]} stopped during the timing (exit"
        f" {self._proc.returncode}): rounds after its last sample get no"
        f" clock; {self.other[-5:]!r}",
        file=sys.stderr,
        flush=True,
      )
    self._stop()
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


def for_kind(table: dict, kind: str):
  """The value of the first of `table`'s GPU names that the device kind
  `kind` ("NVIDIA H200") contains, or None: how a data sheet's figures are
  found, the peak (gpt2.py's `PEAK_BF16`) and its clock alike."""
  return next((v for name, v in table.items() if name in kind), None)


def peak_clock_mhz(kind: str) -> int | None:
  """The clock of `kind`'s data-sheet peak (`PEAK_CLOCK_MHZ`), or None."""
  return for_kind(PEAK_CLOCK_MHZ, kind)


def mfu_at_clock(mfu: float, clock: dict, peak_mhz: int) -> float:
  """`mfu` (over the data sheet's peak at `peak_mhz`) over the peak at the
  mean clock the chip ran (`summary`'s): the share of what the chip could
  do at that clock."""
  return mfu * peak_mhz / clock["sm_mhz_mean"]
