"""GPT-2 small in PyTorch, nanoGPT's recipe: what `benchmarks/gpt2.py` puts
jmp_train beside (`gpt2.py --torch`, the suite's GPU job `gpt2-torch`).

The model is `examples/gpt_model.GPT(tied=True, fused_attention=True)`
written again in PyTorch, layer for layer: the same parameters with the same
shapes (a test loads the Flax params into it and gets the same logits),
LayerNorm's epsilon 1e-6 as Flax's, GELU's tanh form as `flax.linen.gelu`,
logits read off the token embedding, `F.scaled_dot_product_attention` with a
causal mask (flash attention on a GPU). The loss is the mean next-token
cross-entropy, inside the model's forward as nanoGPT has it, so
`torch.compile` fuses it too.

Steps, each nanoGPT's training loop with float32 params:

- torch bf16: `torch.autocast(dtype=torch.bfloat16)` around the forward and
  loss, `torch.compile(model)`, `torch.optim.AdamW(fused=True)`;
- torch fp16: the same under `torch.autocast(dtype=torch.float16)` with
  `torch.amp.GradScaler` (its default dynamic scale: skips non-finite steps).

AdamW has jmp_train's side's settings (`optax.adamw(1e-4)`: lr 1e-4, weight
decay 1e-4 on every param, betas 0.9/0.999, eps 1e-8). `gpt2.py` times the
steps `build` returns as it times its own (`timing.seconds_per_step`).

This module needs torch; jmp_train does not (the test that uses it skips
where torch is absent).
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

EPS = 1e-6  # flax.linen.LayerNorm's epsilon


class Block(nn.Module):
  def __init__(self, d_model: int, heads: int):
    super().__init__()
    self.heads = heads
    self.ln_1 = nn.LayerNorm(d_model, eps=EPS)
    self.qkv = nn.Linear(d_model, 3 * d_model)
    self.proj = nn.Linear(d_model, d_model)
    self.ln_2 = nn.LayerNorm(d_model, eps=EPS)
    self.fc = nn.Linear(d_model, 4 * d_model)
    self.out = nn.Linear(4 * d_model, d_model)

  def forward(self, x):
    b, t, d = x.shape
    qkv = self.qkv(self.ln_1(x)).view(b, t, 3, self.heads, d // self.heads)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
    h = F.gelu(self.fc(self.ln_2(x)), approximate="tanh")
    return x + self.out(h)


class GPT(nn.Module):
  """`gpt_model.GPT(tied=True)`'s layout; `forward` returns the mean
  next-token loss of `tokens` (rows one longer than the context), or the
  logits with `logits=True`."""

  def __init__(self, layers, d_model, heads, seq_len, vocab):
    super().__init__()
    self.embed = nn.Embedding(vocab, d_model)
    self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
    self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
    self.ln_f = nn.LayerNorm(d_model, eps=EPS)
    # nanoGPT's init (Flax's differs: lecun_normal kernels, 1/sqrt(d)
    # embeddings); it changes only the first steps' losses, not the timing.
    for name, p in self.named_parameters():
      if p.dim() > 1:
        nn.init.normal_(p, std=0.02)
      elif name.endswith("bias"):
        nn.init.zeros_(p)

  def forward(self, tokens, logits=False):
    inputs = tokens if logits else tokens[:, :-1]
    x = self.embed(inputs) + self.pos[: inputs.shape[1]]
    for block in self.blocks:
      x = block(x)
    out = F.linear(self.ln_f(x), self.embed.weight)
    if logits:
      return out
    # The loss in float32 (autocast runs cross_entropy in float32 anyway).
    targets = tokens[:, 1:]
    return F.cross_entropy(
      out.float().reshape(-1, out.shape[-1]), targets.reshape(-1)
    )


def load_flax_params(model: GPT, params) -> None:
  """Copies `gpt_model.GPT(tied=True)` params (a Flax tree of arrays) into
  `model`, so the two compute the same function."""

  def t(x):
    return torch.from_numpy(np.array(x, np.float32))

  def dense(layer, p):
    kernel = t(p["kernel"])
    layer.weight.data = kernel.reshape(kernel.shape[0], -1).T.contiguous()
    layer.bias.data = t(p["bias"]).reshape(-1)

  def norm(layer, p):
    layer.weight.data, layer.bias.data = t(p["scale"]), t(p["bias"])

  model.embed.weight.data = t(params["embed"]["embedding"])
  model.pos.data = t(params["pos"])
  for i, block in enumerate(model.blocks):
    p = params[f"block{i}"]
    norm(block.ln_1, p["LayerNorm_0"])
    norm(block.ln_2, p["LayerNorm_1"])
    dense(block.qkv, p["attn"]["qkv"])
    dense(block.proj, p["attn"]["proj"])
    dense(block.fc, p["fc"])
    dense(block.out, p["out"])
  norm(model.ln_f, params["ln_f"])


PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_step(model, device: str, precision: str, compile: bool):
  """One nanoGPT training step on `tokens`; returns the loss (a tensor)."""
  dtype = PRECISIONS[precision]
  opt = torch.optim.AdamW(
    model.parameters(),
    lr=1e-4,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=1e-4,
    fused=True,
  )
  scaler = torch.amp.GradScaler(device, enabled=precision == "fp16")
  forward = torch.compile(model) if compile else model

  def step(tokens):
    with torch.autocast(device, dtype=dtype):
      loss = forward(tokens)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return loss

  return step


def build(cfg, batch, precisions, compile):
  """Each precision's step on one random batch (`steps[name]()` runs one
  and returns its loss), the function that waits for the device, and what
  the results record of torch, the device and the model."""
  device = "cuda" if torch.cuda.is_available() else "cpu"
  if device == "cpu" and cfg["layers"] > 2:
    raise SystemExit(
      f"gpt2.py --torch: torch {torch.__version__} sees no CUDA device; a"
      " full-size run on CPU would be timed beside GPU rows (use --tiny)"
    )
  torch.manual_seed(0)
  gen = torch.Generator().manual_seed(0)
  tokens = torch.randint(
    0, cfg["vocab"], (batch, cfg["seq_len"] + 1), generator=gen
  ).to(device)
  steps = {}
  for precision in precisions:
    model = GPT(**cfg).to(device)
    step = make_step(model, device, precision, compile)
    steps[f"torch {precision}"] = lambda step=step: step(tokens)
  n_params = sum(p.numel() for p in model.parameters())
  return {
    "steps": steps,
    "sync": torch.cuda.synchronize if device == "cuda" else lambda: None,
    "torch": torch.__version__,
    "compiled": compile,
    "device_kind": torch.cuda.get_device_name() if device == "cuda" else "cpu",
    "n_params": n_params,
    "n_params_no_pos": n_params - cfg["seq_len"] * cfg["d_model"],
  }
