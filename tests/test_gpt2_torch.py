"""The PyTorch GPT-2 of benchmarks/gpt2_torch.py is our GPT model, written
again: the same params give the same logits, loss and gradients.

torch is not a dependency of jmp_train: these tests run where it is installed
(`pip install torch==2.13.0`, the CPU build) and skip elsewhere. The table
that compares the two frameworks is tested without torch in
test_benchmarks.py.
"""

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")
)

import gpt2  # noqa: E402
import gpt2_torch  # noqa: E402
import gpt_model  # noqa: E402

CFG = dict(layers=2, d_model=32, heads=4, seq_len=16, vocab=48)


def test_the_torch_model_computes_our_model_from_the_same_params():
  model = gpt_model.GPT(**CFG, tied=True, fused_attention=True)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, CFG["vocab"], (3, CFG["seq_len"] + 1))
  params = model.init(jax.random.key(0), tokens[:1, :-1])["params"]
  # Biases and LayerNorm params away from their 0/1 init, so a swapped or
  # dropped one shows.
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  params = treedef.unflatten(
    [
      x + 0.1 * jax.random.normal(k, x.shape)
      for x, k in zip(leaves, keys, strict=True)
    ]
  )

  def loss(p):
    logits = model.apply({"params": p}, jnp.asarray(tokens[:, :-1]))
    return gpt_model.cross_entropy(logits, jnp.asarray(tokens[:, 1:]))

  want_loss, want_grads = jax.value_and_grad(loss)(params)
  inputs = tokens[:, :-1]
  want_logits = model.apply({"params": params}, jnp.asarray(inputs))

  theirs = gpt2_torch.GPT(**CFG)
  assert sum(p.numel() for p in theirs.parameters()) == sum(
    x.size for x in jax.tree.leaves(params)
  )
  gpt2_torch.load_flax_params(theirs, params)
  batch = torch.from_numpy(tokens)
  with torch.no_grad():
    logits = theirs(torch.from_numpy(inputs), logits=True).numpy()
  np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-5)
  got_loss = theirs(batch)
  got_loss.backward()
  np.testing.assert_allclose(got_loss.item(), want_loss, rtol=1e-5)
  # Gradients: the tied embedding (logits and lookup), a fused qkv bias and
  # the last LayerNorm's scale.
  pairs = [
    (theirs.embed.weight.grad, want_grads["embed"]["embedding"]),
    (
      theirs.blocks[1].qkv.bias.grad,
      want_grads["block1"]["attn"]["qkv"]["bias"].reshape(-1),
    ),
    (theirs.ln_f.weight.grad, want_grads["ln_f"]["scale"]),
  ]
  for got, want in pairs:
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-3, atol=1e-6)


def test_the_torch_benchmark_runs_and_counts_our_params(tmp_path):
  out = tmp_path / "torch.json"
  result = gpt2.main(
    [
      *("--torch", "--tiny", "--no-compile", "--batch", "2"),
      *("--rounds", "1", "--steps-per-round", "1", "--warmup", "2"),
      *("--json", str(out), "--profile", str(tmp_path / "traces")),
    ]
  )
  assert [r["step"] for r in result["rows"]] == ["torch bf16", "torch fp16"]
  # gpt2.py checks --torch-precisions without importing torch.
  assert set(gpt2.TORCH_PRECISIONS) == set(gpt2_torch.PRECISIONS)
  assert all(r["tokens_per_s"] > 0 for r in result["rows"])
  # Two AdamW steps from the same init: the loss is near log(vocab) and
  # finite under both autocasts (fp16 through GradScaler).
  for loss in result["warm_loss"].values():
    assert abs(loss - np.log(gpt2.config(True)["vocab"])) < 0.5
  shapes = gpt_model.init_shapes(gpt_model.GPT(**gpt2.config(True), tied=True))
  assert result["n_params"] == sum(s.size for s in jax.tree.leaves(shapes))
  # --profile: one round of each step under torch.profiler; on a CPU the aten
  # ops' own times stand in for kernels: the matmuls and attention among them.
  assert json.loads(out.read_text())["profiles"] == result["profiles"]
  for name, p in result["profiles"].items():
    trace = tmp_path / "traces" / name.replace(" ", "-") / "trace.json.gz"
    assert trace.exists() and p["found_in_hlo"] is None
    assert p["by_class_us"]["matmul"] > 0 and p["by_class_us"]["attention"] > 0
    # Every op's own time in one class.
    assert sum(p["by_class_us"].values()) == pytest.approx(
      p["kernel_us_per_step"]
    )
    # Own times add up to no less than the ops' union (more where threads
    # overlap), and not to more than the round took.
    assert p["busy_us_per_step"] <= p["kernel_us_per_step"] * (1 + 1e-6)
    assert p["kernel_us_per_step"] <= p["wall_us_per_step"] * 2  # two threads
  assert "| torch fp16 |" in gpt2.profile_table({"t": result})
