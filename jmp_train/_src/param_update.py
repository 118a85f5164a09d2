"""How low-precision params are updated: float32 masters, their remainders,
Kahan summation or rounding.

`mixed_precision(inner, param_update=...)` takes one of five values. They
differ only for float params stored below float32 (bfloat16, float16): float32
and wider params are their own masters under all of them.

| `param_update`              | kept per bf16/fp16 param      | the param after a step       |
|-----------------------------|-------------------------------|------------------------------|
| `MasterWeights()` (default) | a float32 master (4 B)        | its new master cast down     |
| `ParamRemainders()`         | the master's low 16 bits (2 B)| its new master cast down     |
| `KahanSummation()`          | a compensation, param dtype   | `param + update + carry`     |
| `RoundToNearest()`          | nothing                       | `param + update`, to nearest |
| `StochasticRounding(seed)`  | nothing                       | `param + update`, stochastic |

`MasterWeights` is Megatron-LM's float32 main (master) params, NxD's
`use_master_weights=True` and apex O2; `ParamRemainders` is Megatron-Core's
`store_param_remainders` (bfloat16 params only); `KahanSummation` is
AnyPrecisionAdamW's Kahan-compensated bfloat16 update; `RoundToNearest` is
NxD's `use_master_weights=False`, apex O3 and plain optax on bfloat16 params,
and loses every update below half an ulp of its param; `StochasticRounding`
(torchao's `bf16_stochastic_round`) keeps such updates on average.

What the state holds decides how a leaf is updated (`apply`): a float32
master, an int16 remainder, a compensation in the param's dtype, or nothing.
So `adjust_precision` can switch between them under a running
transformation.

Each is a small frozen dataclass, so a setting that only one of them has (the
seed) lives in it, and no combination can be invalid.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src import fp8_param, leaves, rounding


@dataclasses.dataclass(frozen=True)
class MasterWeights:
  """Keep float32 master weights for params stored below float32 (default).

  The inner optimizer updates the master; after `optax.apply_updates` the
  param equals the new master cast to the param dtype, bit for bit.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_train
    >>> tx = jmp_train.mixed_precision(
    ...     optax.sgd(0.1), param_update=jmp_train.MasterWeights())
    >>> tx.init({"w": jnp.ones(2, jnp.bfloat16)}).master_params["w"].dtype
    dtype('float32')
  """


@dataclasses.dataclass(frozen=True)
class RoundToNearest:
  """No master weights: low-precision params take `param + update` rounded
  to nearest in their own dtype (updates below half an ulp are lost).

  Example:
    >>> import jax.numpy as jnp, optax, jmp_train
    >>> tx = jmp_train.mixed_precision(
    ...     optax.sgd(1e-4), param_update=jmp_train.RoundToNearest())
    >>> params = grads = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> updates, _ = tx.update(grads, tx.init(params), params)
    >>> optax.apply_updates(params, updates)["w"]  # 1 - 1e-4 rounds to 1
    Array([1, 1], dtype=bfloat16)
  """


@dataclasses.dataclass(frozen=True)
class ParamRemainders:
  """Keep the low 16 bits of each float32 master beside its bfloat16 param.

  Megatron-Core's `store_param_remainders`: the bfloat16 param is the master
  rounded to nearest even, and the int16 remainder `bits(master) -
  bits(param) << 16` rebuilds the master from the two, at 2 bytes instead of
  4 per param. The run equals the `MasterWeights()` run bit for bit, with
  one exception no 16 bits can avoid: a master exactly halfway above a
  bfloat16 value with an even last bit (`bits(master) = bits(param) << 16 +
  0x8000`, about one value in 2**17) rounds to the same param as the one
  halfway below it, so 2**16 + 1 masters share one param; that one is kept
  one float32 ulp nearer zero (`+ 0x7FFF`), which rounds to the same param. The
  masters then differ by 2**-24 of their value, the size of the float32
  update's own rounding error. From then on the two runs may differ: a later
  master that lands exactly halfway under an odd param rounds up in the
  `MasterWeights()` run and down here.

  For bfloat16 params only: `init` refuses a float16 param (float16 is not
  the top half of a float32). A master beyond bfloat16's largest value
  makes the param inf, as `MasterWeights()` does, and its remainder cannot
  hold the master's bits.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_train
    >>> tx = jmp_train.mixed_precision(
    ...     optax.sgd(1e-4), param_update=jmp_train.ParamRemainders())
    >>> params = grads = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> updates, state = tx.update(grads, tx.init(params), params)
    >>> new = optax.apply_updates(params, updates)
    >>> new["w"], state.master_params["w"]  # 1 - 1e-4: the param stays 1
    (Array([1, 1], dtype=bfloat16), Array([-1678, -1678], dtype=int16))
  """


@dataclasses.dataclass(frozen=True)
class KahanSummation:
  """No float32 master: a Kahan compensation buffer in the param's dtype.

  AnyPrecisionAdamW's update: the compensation `c` carries what rounding
  the param lost, `c += update; new = round(param + c); c -= new - param`,
  here computed in float32 and stored in the param's dtype (2 bytes per
  bfloat16 param). Updates below half an ulp accumulate in `c` until they
  move the param; the inner optimizer sees `param + c`. For bfloat16
  params only: `init` refuses a float16 param (a float16 carry below 6e-8,
  its smallest subnormal, is lost).

  Example:
    >>> import jax.numpy as jnp, optax, jmp_train
    >>> tx = jmp_train.mixed_precision(
    ...     optax.sgd(1.0), param_update=jmp_train.KahanSummation())
    >>> params = {"w": jnp.ones(1, jnp.bfloat16)}
    >>> grads = {"w": jnp.full(1, 2.0**-12, jnp.bfloat16)}  # 1/16 ulp
    >>> state = tx.init(params)
    >>> for _ in range(16):
    ...   updates, state = tx.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params["w"]  # 16 updates of 1/16 ulp moved it one ulp down
    Array([0.996094], dtype=bfloat16)
  """


@dataclasses.dataclass(frozen=True)
class StochasticRounding:
  """No master weights: low-precision params take `param + update` rounded
  stochastically, so updates below half an ulp survive on average.

  The random bits come from `seed`, the step number and the leaf, so a run,
  and a run resumed from a checkpoint, is reproducible.

  Attributes:
    seed: an int >= 0 (NumPy integers are accepted and stored as int).

  Raises:
    ValueError: for a seed that is not an int >= 0.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_train
    >>> tx = jmp_train.mixed_precision(
    ...     optax.sgd(1.0), param_update=jmp_train.StochasticRounding(seed=0))
    >>> params = {"w": jnp.ones(1000, jnp.bfloat16)}
    >>> grads = {"w": jnp.full(1000, 2.0**-12, jnp.bfloat16)}  # 1/16 ulp
    >>> updates, _ = tx.update(grads, tx.init(params), params)
    >>> new = optax.apply_updates(params, updates)["w"]
    >>> sorted(set(new.tolist()))  # about one in sixteen moved down
    [0.99609375, 1.0]
  """

  seed: int = 0

  def __post_init__(self):
    # A plain settings value (not a pytree), so this runs only when a user
    # builds one.
    seed = rounding.check_seed(self.seed, "StochasticRounding seed")
    object.__setattr__(self, "seed", seed)


ParamUpdate = (
  MasterWeights
  | ParamRemainders
  | KahanSummation
  | RoundToNearest
  | StochasticRounding
)

_KINDS = (
  MasterWeights,
  ParamRemainders,
  KahanSummation,
  RoundToNearest,
  StochasticRounding,
)
_ACCEPTED = (
  "jmp_train.MasterWeights(), ParamRemainders(), KahanSummation(), "
  "RoundToNearest() or StochasticRounding(seed=...)"
)


def check(value: Any, name: str = "param_update") -> ParamUpdate:
  """`value` if it is one of the three choices, else a TypeError naming
  `name`, the value and what is accepted."""
  if isinstance(value, _KINDS):
    return value
  hint = ""
  if isinstance(value, type) and issubclass(value, _KINDS):
    hint = f" (a class; pass an instance: {value.__name__}())"
  elif isinstance(value, bool) or value is None:
    hint = (
      " (master_weights=True/False and stochastic_rounding=True became "
      "param_update=MasterWeights(), RoundToNearest() and "
      "StochasticRounding(seed))"
    )
  raise TypeError(f"{name} must be {_ACCEPTED}, got {value!r}{hint}.")


def needs_master(x: Any) -> bool:
  """A float leaf stored below float32: what the choice is about."""
  return leaves.is_float(x) and np.dtype(x.dtype).itemsize < 4


def init_masters(rule: ParamUpdate, params: Any, values: Any = None) -> Any:
  """What `rule` keeps beside `params`, for the float32 `values`.

  Per param stored below float32 (`needs_master`): a float32 copy of its
  entry in `values` (default the param itself) under `MasterWeights`; the
  int16 remainder of that value under `ParamRemainders` (the param must be
  the value rounded to nearest); the compensation `value - param` in the
  param's dtype under `KahanSummation`. `None` everywhere else: a
  placeholder that holds no array and that JAX passes through a jitted
  call in C++ (an `optax.MaskedNode` per param costs a Python call per
  param on every call of the train step: benchmarks/host_cost.py).
  An `Fp8Param` keeps a float32 master under every rule (nothing else can
  update it): its entry in `values`, or the param dequantized.

  Raises:
    TypeError: for `ParamRemainders` or `KahanSummation` and a float16
      param.
  """
  values = params if values is None else values

  def master(path, p, v):
    if fp8_param.is_fp8_param(p):
      v = v.dequantize() if fp8_param.is_fp8_param(v) else v
      return jnp.array(v, jnp.float32)
    if not needs_master(p):
      return None
    if isinstance(rule, MasterWeights):
      return jnp.array(v, jnp.float32)  # a copy, never an alias of `p`
    if isinstance(rule, ParamRemainders):
      if p.dtype != jnp.bfloat16:
        raise TypeError(
          f"param_update=ParamRemainders() keeps the low 16 bits of a "
          f"float32 master beside a bfloat16 param; param "
          f"{leaves.keystr(path)!r} is {np.dtype(p.dtype).name}. Use "
          "MasterWeights() for float16 params."
        )
      return remainder(p, jnp.asarray(v, jnp.float32))
    if isinstance(rule, KahanSummation):
      if p.dtype != jnp.bfloat16:
        # float16 lacks bfloat16's (float32's) exponent range: a carry
        # below its smallest subnormal (6e-8) is lost, one just above rounds
        # to a whole subnormal step (measured: lr 1e-8 never moves, 5e-8
        # moves 19% too far).
        raise TypeError(
          f"param_update=KahanSummation() keeps its compensation in the "
          f"param's dtype, which float16 cannot hold below 6e-8; param "
          f"{leaves.keystr(path)!r} is {np.dtype(p.dtype).name}. Use "
          "MasterWeights() or StochasticRounding(seed) for float16 params."
        )
      wide = jnp.asarray(v, jnp.float32) - p.astype(jnp.float32)
      return wide.astype(p.dtype)
    return None

  return jax.tree_util.tree_map_with_path(
    master, params, values, is_leaf=fp8_param.is_fp8_param
  )


def remainder(param: jax.Array, master: jax.Array) -> jax.Array:
  """The int16 `bits(master) - bits(param) << 16` (see `ParamRemainders`).

  `param` is `master` rounded to nearest even; the one difference that does
  not fit 16 bits, +0x8000, is stored as +0x7FFF.
  """
  hi = jax.lax.bitcast_convert_type(param, jnp.uint16).astype(jnp.int32)
  bits = jax.lax.bitcast_convert_type(master, jnp.int32)
  diff = bits - (hi << 16)
  return jnp.clip(diff, -0x8000, 0x7FFF).astype(jnp.int16)


def from_remainder(param: jax.Array, rem: jax.Array) -> jax.Array:
  """The float32 master that `param` and its int16 remainder stand for."""
  hi = jax.lax.bitcast_convert_type(param, jnp.uint16).astype(jnp.int32)
  bits = (hi << 16) + rem.astype(jnp.int32)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def keeps_nothing(kept: Any) -> bool:
  """Whether what the state keeps beside a param is nothing (`None`)."""
  return kept is None


def full_value(param: Any, kept: Any) -> Any:
  """A float param's float32 value from what the state keeps beside it:
  the master, the master rebuilt from its remainder, `param + compensation`,
  or the param widened."""
  if keeps_nothing(kept):
    return leaves.widen(jnp.asarray(param))
  if kept.dtype == jnp.int16:
    return from_remainder(param, kept)
  if kept.dtype == param.dtype:
    return param.astype(jnp.float32) + kept.astype(jnp.float32)
  return kept


def rebuilt(kept: Any, param: Any) -> Any:
  """What the state keeps beside `param`, rebuilt from the param alone
  (a checkpoint saved without masters): the upcast param, a zero remainder
  or a zero compensation, shaped and typed like `kept`."""
  if keeps_nothing(kept):
    return kept
  if fp8_param.is_fp8_param(param):
    return param.dequantize()
  if np.dtype(kept.dtype) == np.dtype(jnp.float32):
    return jnp.asarray(param).astype(jnp.float32)
  return jnp.zeros(kept.shape, kept.dtype)


def leaf_noise(
  rule: ParamUpdate, params: Any, kept: Any, steps: jax.Array, grouped: bool
) -> Any:
  """The random values each param leaf's stochastic rounding takes at
  update `steps`, else None each: for a float param stored below float32
  that keeps nothing beside it (`kept`, as in `apply`), under
  `StochasticRounding`.

  A bfloat16 param takes 16 bits a value from the stream
  `rounding.stream_key(seed, PARAM_STREAM, steps)`, counted over the
  bfloat16 params that round in the params' leaf order
  (`rounding.stream_bits`, in a few draws where `grouped`: the same bits). A
  float16 param takes `rounding.draw` from `rounding.leaf_key(seed,
  PARAM_STREAM, steps, i)`, `i` its index among the params' leaves. Both are
  functions of the seed, the update's index and the leaf's position only,
  so a resumed run draws the same bits. They are drawn apart from `apply`,
  so that `mixed_precision` draws them before its skip's conditional:
  XLA:GPU turns a conditional without random number generation into
  selects, and keeps one with it (a branch on the host and a copy of every
  output).
  """
  if not isinstance(rule, StochasticRounding):
    return jax.tree.map(lambda p: None, params, is_leaf=fp8_param.is_fp8_param)
  flat, treedef = jax.tree.flatten(params, is_leaf=fp8_param.is_fp8_param)
  flat_kept = treedef.flatten_up_to(kept)
  out, streamed, index = [], [], 0
  for param, keeps in zip(flat, flat_kept, strict=True):
    here = index
    index += len(jax.tree.leaves(param))  # an Fp8Param has several
    if (
      fp8_param.is_fp8_param(param)
      or not needs_master(param)
      or not keeps_nothing(keeps)
    ):
      out.append(None)
    elif param.dtype == jnp.bfloat16:  # filled from the stream below
      streamed.append((len(out), param))
      out.append(None)
    else:
      key = rounding.leaf_key(rule.seed, rounding.PARAM_STREAM, steps, here)
      out.append(
        rounding.draw_for_one(key, param.shape, jnp.float32, param.dtype)
      )
  key = rounding.stream_key(rule.seed, rounding.PARAM_STREAM, steps)
  shapes = [param.shape for _, param in streamed]
  layouts = [rounding.layout_of(param) for _, param in streamed]
  drawn = rounding.stream_bits(key, shapes, grouped, layouts)
  for (k, _), bits in zip(streamed, drawn, strict=True):
    out[k] = bits
  return jax.tree.unflatten(treedef, out)


class LeafUpdate(NamedTuple):
  """What `apply` gives for one param leaf."""

  update: Any
  master: Any


def apply(
  rule: ParamUpdate, param: Any, kept: Any, update: Any, noise: Any
) -> LeafUpdate:
  """The update to emit for one param leaf, and what the state keeps after.

  `update` is the inner optimizer's (float32 or wider). What the state
  keeps beside the param decides, whatever `rule` says, so
  `adjust_precision` can add or drop masters under a running
  transformation: a float32 master or an int16 remainder makes the param
  follow its new master (`exact_delta`); a compensation in the param's
  dtype makes a Kahan step; nothing makes the param take `param + update`,
  rounded as `rule` says. Integer and boolean params get zeros. An
  `Fp8Param` is cast again from its new master (`fp8_param.cast_param`); its
  update is the exact difference of bits and exponents. `noise` is the
  leaf's from `leaf_noise` (None where it does not round stochastically).
  """
  if fp8_param.is_fp8_param(param):
    master = (kept + update).astype(jnp.float32)
    return LeafUpdate(
      fp8_param.delta(param, fp8_param.cast_param(master)), master
    )
  if not leaves.is_float(param):
    return LeafUpdate(jnp.zeros_like(param), kept)
  if keeps_nothing(kept):
    if isinstance(rule, StochasticRounding) and needs_master(param):
      wide = param.astype(jnp.float32)
      new = rounding.round_leaf(wide + update, param.dtype, noise)
      return LeafUpdate(new.astype(jnp.float32) - wide, kept)
    return LeafUpdate(update.astype(leaves.full_dtype(param.dtype)), kept)
  if kept.dtype == jnp.int16:
    delta, master = exact_delta(param, from_remainder(param, kept) + update)
    return LeafUpdate(delta, remainder(master.astype(param.dtype), master))
  if kept.dtype == param.dtype:
    wide = param.astype(jnp.float32)
    carry = kept.astype(jnp.float32) + update
    delta = (wide + carry).astype(param.dtype).astype(jnp.float32) - wide
    return LeafUpdate(delta, (carry - delta).astype(kept.dtype))
  new_master = (kept + update).astype(jnp.float32)
  return LeafUpdate(*exact_delta(param, new_master))


def exact_delta(param: jax.Array, master: jax.Array) -> tuple:
  """The float32 update taking `param` to `cast(master)`, and the master.

  `optax.apply_updates` computes `cast(float32(param) + update)`. The update
  is `master - float32(param)` and the master kept is
  `float32(param) + update`, the very value `apply_updates` casts, so after
  it the params equal the kept master cast down, bit for bit, on every step.
  The subtraction is exact, and the kept master is the new one, unless the
  param halves, changes sign or grows more than 2**16-fold (2**13 for
  float16) in one step; then the kept master differs from the new one by at
  most one float32 ulp of the update, the size of the update's own
  rounding. (`cast(master) - float32(param)` would keep the master but
  misses `cast(master)` where the new value is below about 2**-16 of the
  old one: no float32 update reaches it.)
  """
  delta = master - param.astype(jnp.float32)
  return delta, param.astype(jnp.float32) + delta
