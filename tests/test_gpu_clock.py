"""benchmarks/gpu_clock.py: nvidia-smi's samples read, kept to a step's
timed rounds and summed up, and the GPT-2 tables' clock columns. nvidia-smi
itself is replaced by a small program that prints lines in its format."""

import argparse
import calendar
import pathlib
import sys
import time

import pytest

sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")
)

import gpt2
import gpu_clock
from _fake_smi import failing_smi, fake_smi


@pytest.fixture
def new_york(monkeypatch):
  """Local time five hours behind UTC in November, so that reading a stamp
  as UTC, not local time, shows."""
  monkeypatch.setenv("TZ", "America/New_York")
  time.tzset()
  yield
  monkeypatch.undo()
  time.tzset()


def test_a_line_of_nvidia_smi_reads_as_a_sample(new_york):
  # Lines as nvidia-smi printed them on the H200 of 2026-11-27, its stamp in
  # local time: 15:00 in New York (EST) is 20:00 UTC.
  got = gpu_clock.parse_line("2026/11/27 15:00:07.512, 1635, 693.95, 0x4\n")
  want = calendar.timegm((2026, 11, 27, 20, 0, 7)) + 0.512
  assert got == {"t": pytest.approx(want), "mhz": 1635, "watts": 693.95} | {
    "bits": 4
  }
  got = gpu_clock.parse_line(
    "2026/11/27 14:59:14.726, 345, [N/A], 0x0000000000000001"
  )
  assert got["watts"] is None and got["bits"] == 1 and got["mhz"] == 345
  for not_a_sample in ("", "No devices were found", "a, b, c, d", "1, 2"):
    assert gpu_clock.parse_line(not_a_sample) is None


def test_summary_keeps_the_samples_inside_the_windows():
  def at(t, mhz, watts, bits):
    return {"t": t, "mhz": mhz, "watts": watts, "bits": bits}

  samples = [
    at(0.5, 1980, 300.0, 0x0),  # before the first window
    at(1.0, 1700, 690.0, 0x4),  # SW power cap
    at(1.5, 1650, None, 0x80),  # HW power brake, no reading
    at(2.5, 1980, 100.0, 0x0),  # between the windows
    at(3.0, 1800, 650.0, 0x1),  # idle: not a power bit
    at(3.9, 1750, 610.0, 0x0),  # on the second window's end
    at(4.0, 1800, 650.0, 0x4),  # just after the second window
  ]
  got = gpu_clock.summary(samples, [(1.0, 2.0), (2.9, 3.9)])
  # Written out: the samples at 1.0, 1.5, 3.0 and 3.9 (ends count).
  assert got == {
    "samples": 4,
    "sm_mhz_mean": round((1700 + 1650 + 1800 + 1750) / 4, 1),
    "sm_mhz_min": 1650,
    "sm_mhz_max": 1800,
    "watts_mean": round((690.0 + 650.0 + 610.0) / 3, 1),
    "power_capped_share": 0.5,
  }
  assert gpu_clock.summary(samples, [(5.0, 6.0)]) is None
  assert gpu_clock.summary(samples, []) is None


def test_the_sampler_reads_a_running_program_and_stops_it(new_york):
  before = time.time()
  with gpu_clock.Sampler(5, cmd=fake_smi(5, 1000, 0x4)) as sampler:
    # Entered once the first sample is in: the start-up is not timed.
    assert sampler.samples
    time.sleep(0.3)
    end = time.time()
  assert sampler._proc.poll() is not None  # stopped
  got = sampler.samples
  assert len(got) >= 10  # 60 at most; fewer on a loaded machine
  # The warning line is not a sample; the rest in order, one MHz apart.
  assert sampler.other == ["WARNING: a line that is not a sample"]
  assert [s["mhz"] for s in got] == list(range(1000, 1000 + len(got)))
  assert all(a["t"] <= b["t"] for a, b in zip(got, got[1:], strict=False))
  # Stamped by the program's local clock, which is time.time()'s.
  assert before - 1 < got[0]["t"] and got[-1]["t"] < end + 1
  # The samples of the last period before the exit are read too.
  assert got[-1]["t"] > end - 0.1


def test_a_program_that_gives_no_sample_fails_before_the_timing(monkeypatch):
  with pytest.raises(
    RuntimeError, match="stopped without a sample .exit 9.*NVML"
  ):
    with gpu_clock.Sampler(5, cmd=failing_smi()):
      pytest.fail("entered without a sample")
  # One that prints nothing in time is stopped and refused alike.
  silent = [sys.executable, "-c", "import time; time.sleep(60)"]
  start = time.monotonic()
  with pytest.raises(RuntimeError, match="gave no sample in 1 s"):
    with gpu_clock.Sampler(5, cmd=silent, first_within=1.0):
      pass
  assert time.monotonic() - start < 15
  # gpt2.py asks for one sample before any work.
  monkeypatch.setattr(gpu_clock, "available", lambda: True)
  monkeypatch.setattr(gpu_clock, "command", lambda ms: failing_smi())
  with pytest.raises(SystemExit, match="--clocks: nvidia-smi gave no sample"):
    gpt2.main(["--tiny", "--clocks", "100"])
  monkeypatch.setattr(gpu_clock, "command", lambda ms: fake_smi(ms, 1500, 0))
  assert gpu_clock.check()["mhz"] == 1500


def test_each_step_gets_the_clock_of_its_own_rounds(monkeypatch):
  # time_steps wraps each round in a window; a round lasts 0.15 s and the
  # fake prints every 5 ms, its clock rising one MHz a line. Two rounds in
  # rotated order, a b then b a: b's two rounds lie between a's, so a saw
  # both lower and higher clocks than b did.
  monkeypatch.setattr(gpu_clock, "command", lambda ms: fake_smi(ms, 1000, 4))
  args = argparse.Namespace(clocks=5, rounds=2, steps_per_round=1)
  seconds, clocks = gpt2.time_steps(
    args, ["a", "b"], lambda name: time.sleep(0.15)
  )
  assert set(seconds) == {"a", "b"} and seconds["a"] >= 0.15
  a, b = clocks["a"], clocks["b"]
  assert a["samples"] >= 3 and b["samples"] >= 3
  assert a["sm_mhz_min"] < b["sm_mhz_min"] <= b["sm_mhz_max"] < a["sm_mhz_max"]
  assert a["power_capped_share"] == 1.0
  # Without --clocks: the timing alone.
  args.clocks = None
  assert gpt2.time_steps(args, ["a"], lambda name: None)[1] is None


def test_clocks_are_refused_where_they_cannot_be_read(monkeypatch, capsys):
  # Without nvidia-smi on PATH: refused as the run starts, before any work.
  monkeypatch.setattr(gpu_clock, "available", lambda: False)
  with pytest.raises(SystemExit, match="--clocks reads nvidia-smi, which is"):
    gpt2.main(["--tiny", "--clocks", "100"])
  assert gpt2.parse_args(["--tiny", "--clocks", "100"]).clocks == 100
  for bad in (["--clocks", "0"], ["--clocks", "100", "--kernels"]):
    with pytest.raises(SystemExit):
      gpt2.parse_args(["--tiny", *bad])
  err = capsys.readouterr().err
  assert "must be >= 1, got 0" in err and "drop --kernels" in err


def run(rows, framework=None, peak_clock_mhz=1830, steps_per_round=30):
  result = dict(model="GPT", batch=16, device="NVIDIA H200, x86_64")
  result.update(n_params=100, peak_bf16_tflops=989.4)
  result.update(steps_per_round=steps_per_round, rounds=5)
  result.update(clock_ms=100, peak_clock_mhz=peak_clock_mhz)
  result["rows"] = [
    dict(step=name, ms=1.0, steps_per_s=1.0, tokens_per_s=1000)
    | dict(tflops=1.0, mfu=mfu, ratio_vs_plain=1.0, clock=clock)
    for name, mfu, clock in rows
  ]
  if framework:
    result.update(framework="torch 2.11.0", torch_compile=True)
  return result


def clock(mean, least, most, watts=690.0, share=0.975, samples=40):
  return dict(samples=samples, sm_mhz_mean=mean, sm_mhz_min=least) | dict(
    sm_mhz_max=most, watts_mean=watts, power_capped_share=share
  )


def test_the_gpt2_table_gives_each_rows_clock_and_mfu_at_it():
  ours = run(
    [
      ("hand-bf16", 0.4346, clock(1700.0, 1635, 1980)),
      ("bf16-mixed", 0.4329, clock(1694.0, 1635, 1980, watts=660.2)),
      ("fp16-mixed", 0.4176, None),  # not sampled
    ]
  )
  text = gpt2.table({"gpt2": ours})
  assert "| SM MHz, mean (least-most) | MFU at that clock |" in text
  # MFU over the peak at 1830 MHz, rescaled to the mean clock (written out).
  want = f"{100 * 0.4329 * 1830 / 1694.0:.1f}%"
  assert want == "46.8%"
  assert f"| 1694 (1635-1980) | {want} |" in text
  assert "| 41.8% | 1.000x | n/a | n/a |" in text
  # The verdict stays on the data sheet's peak; the sentence after it says
  # what the clock was.
  assert "43.3% at 30 steps per wait, **not met**" in text
  assert (
    "the SMs ran at 1694 MHz on average, 660 W, held down for power in 98%"
    " of 40 samples; the data sheet's peak is quoted at 1830 MHz, so at the"
    " clock it ran the step reached 46.8% of the chip's peak." in text
  )
  # A device whose peak clock is not known: the clock, no rescaled MFU.
  unknown = run([("bf16-mixed", 0.43, clock(1500.0, 1400, 1600))], None, None)
  text = gpt2.table({"gpt2": unknown})
  assert "| 1500 (1400-1600) | n/a |" in text
  assert "the SMs ran" not in text
  # No run sampled: no clock columns.
  bare = run([("bf16-mixed", 0.43, None)])
  assert "SM MHz" not in gpt2.table({"gpt2": bare})


def test_the_torch_table_names_both_sides_clocks():
  ours = run([("bf16-mixed", 0.43, clock(1694.0, 1635, 1980))])
  theirs = run([("torch bf16", 0.41, clock(1720.4, 1650, 1980))], "torch")
  text = gpt2.torch_table({"a": ours, "b": theirs})
  assert (
    "Mean SM clock over the timed rounds: bf16 (bf16-mixed, loss logits):"
    " 1694 MHz against PyTorch's 1720." in text
  )
  unsampled = run([("torch bf16", 0.41, None)], "torch")
  assert "Mean SM clock" not in gpt2.torch_table({"a": ours, "b": unsampled})


def test_peak_clocks_give_the_data_sheets_peaks():
  # 989.4 TFLOP/s = 132 SMs x 4096 dense bf16 FLOP per clock x 1830 MHz;
  # 312 = 108 x 2048 x 1410 MHz (gpt2.PEAK_BF16's figures).
  per_clock = {"H100": 132 * 4096, "H200": 132 * 4096, "A100": 108 * 2048}
  for kind, flop in per_clock.items():
    mhz = gpu_clock.peak_clock_mhz(f"NVIDIA {kind}")
    assert flop * mhz * 1e6 == pytest.approx(gpt2.PEAK_BF16[kind], rel=1e-3)
  assert gpu_clock.peak_clock_mhz("cpu") is None
