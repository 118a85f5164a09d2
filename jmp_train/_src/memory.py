"""Per-device memory and communication accounting for a train step.

`memory_table(plan, state)` counts, per device, the bytes of params,
gradients, master weights, optimizer state and the rest of the train state
from the shardings a `zero1.Plan` gives them (like NeMo RL's memory tables);
`compiled_memory(step, state, batch)` reads what XLA allocates for the
compiled step (`memory_analysis()`), to check the table against.
`collective_stats(hlo_text, n)` counts the collectives in an HLO module and
the bytes each device sends for them.

Everything here reads shapes, shardings and compiled programs; nothing
allocates a state or changes how JAX is configured. The command-line table
for GPT-2 sizes is `benchmarks/memory_table.py`.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jmp_train._src import (
  accumulation,
  fp8_param,
  leaves,
  optimizer_state,
  zero1,
)


def _device_bytes(x: Any) -> int:
  """Bytes of the largest shard of `x` (all of it without a sharding)."""
  sharding = getattr(x, "sharding", None)
  shape = sharding.shard_shape(tuple(x.shape)) if sharding else x.shape
  # `dtype.itemsize`, not np.dtype(...): typed PRNG keys have one too.
  return math.prod(shape) * x.dtype.itemsize


def _tree_bytes(tree: Any) -> int:
  return sum(_device_bytes(x) for x in jax.tree.leaves(tree))


def _with_shardings(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    tree,
    shardings,
  )


def memory_table(
  plan: zero1.Plan | None,
  state: Any,
  *,
  accum_steps: int = 1,
  accum_dtype: Any = jnp.float32,
) -> dict[str, int]:
  """Bytes per device of each part of a train state laid out by `plan`.

  Counts the largest shard of every leaf under the plan's shardings (the
  optimizer state padded as ZeRO-1 stores it); nothing is allocated.

  Args:
    plan: a `jmp_train.zero1.Plan`, or None for one device.
    state: a `jmp_train.train.TrainState` holding the logical optimizer
      state (as `TrainState.create` without a plan builds it), concrete or
      abstract: `jax.eval_shape(lambda p: TrainState.create(params=p,
      tx=tx), params)` needs no memory.
    accum_steps: micro-batches per step; above 1 the step keeps a gradient
      accumulation buffer.
    accum_dtype: the step's `accum_dtype` (`jnp.float32` or
      `jnp.bfloat16`), the buffer's dtype when `accum_steps > 1`.

  Returns:
    A dict with `params`; `gradients` (one copy of the gradients in the
    params' dtypes, the buffer the backward pass fills, or the accumulation
    buffer when `accum_steps > 1`: float32 at least, or bfloat16 with
    `accum_dtype=jnp.bfloat16`, float64 and complex leaves in their own
    dtype either way); `master_weights` (the
    float32 copies `mixed_precision` keeps); `optimizer_state` (the rest of
    the optimizer state); `other_state` (model state such as BatchNorm
    statistics, FP8 metadata, the step counter and the PRNG key); and
    `total`. The compiled step's argument bytes are `total - gradients`
    plus the batch's.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jmp_train
    >>> tx = jmp_train.mixed_precision(optax.sgd(0.1))
    >>> params = {"w": jax.ShapeDtypeStruct((256,), jnp.bfloat16)}
    >>> state = jax.eval_shape(
    ...     lambda p: jmp_train.train.TrainState.create(params=p, tx=tx),
    ...     params)
    >>> table = memory_table(None, state)
    >>> table["params"], table["master_weights"]
    (512, 1024)
  """
  accum_steps = leaves.check_int(accum_steps, "accum_steps", 1)
  accum_dtype = accumulation.check_gradient_dtype(accum_dtype, "accum_dtype")
  if plan is None:
    stored = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state
    )
    param_shardings = jax.tree.map(lambda _: None, state.params)
  else:
    zero1.check_tree(
      state.opt_state,
      plan.logical_opt_state,
      "state.opt_state",
      "Pass the logical state of this plan's optimizer and params (built "
      "without a plan, or zero1.to_logical of a laid-out one).",
    )
    stored = zero1.abstract(plan, state)
    param_shardings = plan.param_shardings
  master = sum(
    _tree_bytes(s.master_params)
    for s in optimizer_state.mixed_precision_states(stored.opt_state)
  )

  def grad(p):
    dtype = p.dtype
    if accum_steps > 1 and leaves.is_float(p):
      dtype = accumulation.buffer_dtype(dtype, accum_dtype)
    return jax.ShapeDtypeStruct(p.shape, dtype)

  # An Fp8Param's gradient is its weight's, in its `grad_dtype`.
  grads = jax.tree.map(grad, fp8_param.grad_like(state.params))
  grads = _with_shardings(grads, param_shardings)
  table = {
    "params": _tree_bytes(stored.params),
    "gradients": _tree_bytes(grads),
    "master_weights": master,
    "optimizer_state": _tree_bytes(stored.opt_state) - master,
    "other_state": _tree_bytes(
      (stored.model_state, stored.fp8, stored.step, stored.key)
    ),
  }
  table["total"] = sum(table.values())
  return table


def compiled_memory(step: Any, state: Any, batch: Any) -> dict[str, int]:
  """What XLA allocates per device for the compiled step.

  Args:
    step: a jitted step (`jmp_train.train.make_train_step`).
    state: the state it takes, concrete or abstract (for a plan's layout,
      `zero1.abstract(plan, state)`).
    batch: a batch, concrete or `jax.ShapeDtypeStruct`s.

  Returns:
    `argument` (the train state and the batch), `output`, `temp`
    (activations, gradients, workspace) and `alias` bytes from
    `step.lower(state, batch).compile().memory_analysis()`.
  """
  analysis = step.lower(state, batch).compile().memory_analysis()
  return {
    "argument": int(analysis.argument_size_in_bytes),
    "output": int(analysis.output_size_in_bytes),
    "temp": int(analysis.temp_size_in_bytes),
    "alias": int(analysis.alias_size_in_bytes),
  }


class Collective(NamedTuple):
  """One collective op of an HLO module.

  `bytes` is the data each device sends with a ring algorithm: an all-reduce
  of S bytes over g devices sends 2 S (g-1)/g, a reduce-scatter of S input
  bytes or an all-gather of S output bytes sends S (g-1)/g; a
  collective-permute sends its whole S-byte buffer.
  """

  kind: str
  shape_bytes: int
  group_size: int
  bytes: float
  max_elements: int  # the largest operand's element count (1: scalars)


_OP = re.compile(
  r"= (?P<type>.+?) (?P<kind>all-reduce|reduce-scatter|all-gather|"
  r"all-to-all|collective-permute)(?P<start>-start)?\((?P<args>[^)]*)\)"
  r"(?P<rest>.*)$"
)
_SHAPE = re.compile(r"\b(pred|bf16|[fsuc]\d+\w*)\[([\d,]*)\]")


def _bits(dtype: str) -> int:
  """Bits per element of an HLO element type: pred, bf16, f32, f8e4m3fn,
  s4, u16, c64, ..."""
  if dtype == "pred":
    return 8
  if dtype == "bf16":
    return 16
  return int(re.match(r"[fsuc](\d+)", dtype).group(1))


def _shapes(text: str) -> list[tuple[str, int]]:
  """(element type, element count) of each array shape in `text`."""
  return [
    (dtype, math.prod(int(d) for d in dims.split(",") if d))
    for dtype, dims in _SHAPE.findall(text)
  ]


def _shape_bytes(text: str) -> int:
  return sum(size * _bits(dtype) // 8 for dtype, size in _shapes(text))


def _max_elements(text: str) -> int:
  return max((size for _, size in _shapes(text)), default=0)


def _tuple_elements(text: str) -> list[str]:
  """The top-level elements of an HLO tuple type, "(a, (b, c), d)"; a type
  that is not a tuple as the only element."""
  if not text.startswith("("):
    return [text]
  elements, depth, begin = [], 0, 1
  for i, ch in enumerate(text):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if (ch == "," and depth == 1) or depth == 0:
      elements.append(text[begin:i].strip())
      begin = i + 1
    if depth == 0:
      break
  return elements


def _group_size(rest: str, num_devices: int) -> int:
  m = re.search(r"replica_groups=\{\{([\d,]+)\}", rest)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"source_target_pairs=\{(\{[\d,{}]*\})\}", rest)
  if m:  # a collective-permute: the devices its pairs name
    return len(set(re.findall(r"\d+", m.group(1))))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]", rest)
  if m:
    return int(m.group(2))
  return num_devices


def collective_stats(hlo_text: str, num_devices: int) -> list[Collective]:
  """The collectives of an HLO module's text, and the bytes each sends.

  Pass `lowered.as_text(dialect="hlo")` for the collectives a step asks for
  in the dtypes it asks for (the train step writes its own with
  `shard_map`), or `compiled.as_text()` for what XLA runs, with the
  collectives sharding propagation adds. XLA:CPU widens bfloat16
  collectives to float32 when it compiles, so on CPU a compiled module
  counts them at 4 bytes a value. The asynchronous forms XLA:GPU emits
  (`all-gather-start`, `reduce-scatter-start`, `all-to-all-start`,
  `collective-permute-start`), whose results hold their input buffers too,
  count their output only.

  Args:
    hlo_text: an HLO module as text.
    num_devices: the devices of a collective whose replica groups the text
      does not give.

  Returns:
    One `Collective` per collective op, in the order of the text.
  """
  if isinstance(num_devices, bool) or not isinstance(num_devices, int):
    raise TypeError(f"num_devices must be an int, got {num_devices!r}.")
  if num_devices < 1:
    raise ValueError(f"num_devices must be 1 or more, got {num_devices}.")
  found = []
  for line in hlo_text.splitlines():
    m = _OP.search(line)
    if not m:
      continue
    kind, out_type = m.group("kind"), m.group("type")
    if m.group("start") and kind != "all-reduce":
      # (inputs, outputs[, contexts]): the outputs are what arrives. An
      # all-reduce-start's result holds its outputs alone.
      elements = _tuple_elements(out_type)
      out_type = elements[1] if len(elements) > 1 else out_type
    g = _group_size(m.group("rest"), num_devices)
    out_bytes = _shape_bytes(out_type)
    if kind == "reduce-scatter":
      size = out_bytes * g  # the input
      sent = size * (g - 1) / g
    elif kind == "all-reduce":
      size = out_bytes
      sent = 2 * size * (g - 1) / g
    elif kind == "collective-permute":
      size = sent = out_bytes
    else:
      size = out_bytes
      sent = size * (g - 1) / g
    found.append(Collective(kind, size, g, sent, _max_elements(out_type)))
  return found


def summarize_collectives(found: list[Collective]) -> dict[str, dict]:
  """Count and bytes sent per collective kind, plus `total_bytes`."""
  out: dict[str, Any] = {}
  for c in found:
    entry = out.setdefault(
      c.kind, {"count": 0, "bytes": 0.0, "largest": 0, "max_elements": 0}
    )
    entry["count"] += 1
    entry["bytes"] += c.bytes
    entry["largest"] = max(entry["largest"], c.shape_bytes)
    entry["max_elements"] = max(entry["max_elements"], c.max_elements)
  out["total_bytes"] = sum(c.bytes for c in found)
  return out
