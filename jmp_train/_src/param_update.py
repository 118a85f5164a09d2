"""How low-precision params are updated: float32 master weights or rounding.

`mixed_precision(inner, param_update=...)` takes one of three values. They
differ only for float params stored below float32 (bfloat16, float16): float32
and wider params are their own masters under all three.

| `param_update`              | kept per bf16/fp16 param | the param after a step       |
|-----------------------------|--------------------------|------------------------------|
| `MasterWeights()` (default) | a float32 master (4 B)   | its new master cast down     |
| `RoundToNearest()`          | nothing                  | `param + update`, to nearest |
| `StochasticRounding(seed)`  | nothing                  | `param + update`, stochastic |

`MasterWeights` is Megatron-LM's float32 main (master) params, NxD's
`use_master_weights=True` and apex O2; `RoundToNearest` is NxD's
`use_master_weights=False`, apex O3 and plain optax on bfloat16 params, and
loses every update below half an ulp of its param; `StochasticRounding`
(torchao's `bf16_stochastic_round`) keeps such updates on average.

Each is a small frozen dataclass, so a setting that only one of them has (the
seed) lives in it, and no combination can be invalid.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src import leaves, rounding


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
    seed = leaves.check_int(self.seed, "StochasticRounding seed")
    object.__setattr__(self, "seed", seed)


ParamUpdate = MasterWeights | RoundToNearest | StochasticRounding

_KINDS = (MasterWeights, RoundToNearest, StochasticRounding)
_ACCEPTED = (
  "jmp_train.MasterWeights(), jmp_train.RoundToNearest() or "
  "jmp_train.StochasticRounding(seed=...)"
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
  """The float32 masters `rule` keeps for `params`.

  A float32 copy of each param that needs one (of its entry in `values`,
  default the param itself) under `MasterWeights`; `optax.MaskedNode()`
  everywhere else.
  """
  values = params if values is None else values

  def master(p, v):
    if isinstance(rule, MasterWeights) and needs_master(p):
      return jnp.asarray(v, jnp.float32)
    return leaves.MASKED

  return jax.tree.map(master, params, values)


def leaf_keys(rule: ParamUpdate, params: Any, steps: jax.Array) -> Any:
  """One PRNG key per param leaf for stochastic rounding, else None each.

  The key of a leaf is a function of the seed, the step number and the
  leaf's position only, so a resumed run draws the same bits.
  """
  flat, treedef = jax.tree.flatten(params)
  if not isinstance(rule, StochasticRounding):
    return jax.tree.unflatten(treedef, [None] * len(flat))
  step_key = jax.random.fold_in(jax.random.key(rule.seed), steps)
  keys = jax.random.split(step_key, max(len(flat), 1))
  return jax.tree.unflatten(treedef, list(keys[: len(flat)]))


class LeafUpdate(NamedTuple):
  """What `apply` gives for one param leaf."""

  update: Any
  master: Any


def apply(
  rule: ParamUpdate, param: Any, master: Any, update: Any, key: Any
) -> LeafUpdate:
  """The update to emit for one param leaf, and its master after the step.

  `update` is the inner optimizer's (float32 or wider). Where the state
  holds a master the param follows it (`exact_delta`), whatever `rule` says:
  the state decides, so `adjust_precision` can add or drop masters under a
  running transformation. Integer and boolean params get zeros.
  """
  if not leaves.is_float(param):
    return LeafUpdate(jnp.zeros_like(param), master)
  if not leaves.is_masked(master):
    new_master = (master + update).astype(jnp.float32)
    return LeafUpdate(*exact_delta(param, new_master))
  if isinstance(rule, StochasticRounding) and needs_master(param):
    wide = param.astype(jnp.float32)
    new = rounding.cast_stochastic(wide + update, param.dtype, key)
    return LeafUpdate(new.astype(jnp.float32) - wide, master)
  return LeafUpdate(update.astype(leaves.full_dtype(param.dtype)), master)


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
