"""Policies: jmp compatibility, parsing, casts against NumPy references."""

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jmp_train
import jmp_train as jmp  # the one-line change a jmp user makes

HALF_DTYPES = (np.float16, jnp.float16, jnp.bfloat16)
FULL_DTYPES = (np.float32, jnp.float32)
DTYPES = HALF_DTYPES + FULL_DTYPES
NAMES = {
  np.dtype(np.float16): "float16",
  np.dtype(jnp.bfloat16): "bfloat16",
  np.dtype(np.float32): "float32",
}


def test_jmp_readme_policy_examples():
  # jmp's README, "Policies" section, with only the import changed.
  half = jnp.float16
  full = jnp.float32
  my_policy = jmp.Policy(
    compute_dtype=half, param_dtype=full, output_dtype=half
  )

  def layer(params, x):
    params, x = my_policy.cast_to_compute((params, x))
    w = params["w"]
    y = x @ w
    return my_policy.cast_to_output(y)

  params = {"w": jnp.ones([3, 3], dtype=my_policy.param_dtype)}
  y = layer(params, jnp.ones([2, 3]))
  assert y.dtype == half
  my_policy = my_policy.with_output_dtype(full)
  assert my_policy.output_dtype == full
  my_policy = jmp.get_policy("params=float32,compute=float16,output=float32")
  assert my_policy == jmp.get_policy("p=f32,c=f16,o=f32")
  float16 = jmp.get_policy("float16")
  assert float16.compute_dtype == jnp.float16
  half_policy = jmp.get_policy("half")
  assert half_policy.param_dtype == jmp.half_dtype()


@pytest.mark.parametrize(
  "dtype,np_", list(itertools.product(DTYPES, (np, jnp)))
)
@pytest.mark.parametrize("which", ["param", "compute", "output"])
def test_casts_follow_policy(dtype, np_, which):
  policy = jmp.Policy(dtype, dtype, dtype)
  assert getattr(policy, f"{which}_dtype") == dtype
  out = getattr(policy, f"cast_to_{which}")({"a": np_.ones([])})
  assert out["a"].dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_get_policy_grammar_defaults(dtype):
  name = NAMES[np.dtype(dtype)]
  assert jmp.get_policy(name) == jmp.Policy(dtype, dtype, dtype)
  mixed = jmp.get_policy(f"c={name}")
  assert (mixed.param_dtype, mixed.compute_dtype, mixed.output_dtype) == (
    jnp.float32,
    dtype,
    dtype,
  )
  compute = jmp.get_policy(f"c={name},o=full")
  assert compute.output_dtype == jnp.float32
  params_only = jmp.get_policy(f"p={name}")
  assert params_only == jmp.Policy(dtype, dtype, dtype)


@pytest.mark.parametrize(
  "alias,dtype",
  [
    ("f32", jnp.float32),
    ("float32", jnp.float32),
    ("full", jnp.float32),
    ("single", jnp.float32),
    ("bf16", jnp.bfloat16),
    ("bfloat16", jnp.bfloat16),
    ("f16", jnp.float16),
    ("float16", jnp.float16),
    ("half", jnp.float16),
    ("f64", jnp.float64),
    ("BF16", jnp.bfloat16),
  ],
)
def test_dtype_aliases(alias, dtype):
  assert jmp.get_policy(f"params={alias}").param_dtype == dtype


def test_half_dtype_is_callable_like_jmp():
  assert jmp.half_dtype() is jnp.float16  # CPU
  assert jmp.half_dtype()(2**15).dtype == np.float16


def test_policy_is_normalised_hashable_and_round_trips():
  a = jmp.Policy(jnp.float32, jnp.bfloat16, np.float32)
  b = jmp.Policy(np.dtype("float32"), "bf16", "float32")
  assert a == b and hash(a) == hash(b) and len({a, b}) == 1
  for p, c, o in itertools.product(
    ["float32", "bfloat16", "float16"], repeat=3
  ):
    policy = jmp.get_policy(f"params={p},compute={c},output={o}")
    assert jmp.get_policy(str(policy)) == policy
    assert eval(repr(policy), {"get_policy": jmp.get_policy}) == policy
  assert a.with_param_dtype("f16").param_dtype == jnp.float16
  assert a.with_compute_dtype(jnp.float32).compute_dtype == jnp.float32
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.param_dtype = jnp.float16


@pytest.mark.parametrize(
  "bad,fragments",
  [
    ("params=float33", ["'float33'", "accepted names", "bfloat16"]),
    ("p=f32,x=bf16", ["'x'", "accepted keys", "params (p)"]),
    ("p=f32,params=bf16", ["'params'", "twice"]),
    ("c=f16,c=f16", ["'c'", "twice"]),
    ("", ["Empty policy string", "params=float32"]),
    ("   ", ["Empty policy string"]),
    ("p=f32,,c=bf16", ["Bad part ''", "key=dtype"]),
    ("p=", ["Bad part 'p='"]),
    ("compute_float16", ["Unknown dtype 'compute_float16'"]),  # jmp's message
    ("float8_e4m3fn", ["Unknown dtype", "accepted names"]),
  ],
)
def test_bad_policy_strings_name_the_bad_part(bad, fragments):
  with pytest.raises(ValueError) as err:
    jmp.get_policy(bad)
  for fragment in fragments:
    assert fragment in str(err.value)


def test_bad_policy_dtypes():
  with pytest.raises(ValueError, match="int32"):
    jmp.Policy(jnp.int32, jnp.float32, jnp.float32)
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    jmp.Policy(jnp.float32, jnp.float8_e4m3fn, jnp.float32)
  with pytest.raises(TypeError, match="floating dtype"):
    jmp.Policy(object(), jnp.float32, jnp.float32)
  with pytest.raises(TypeError, match="string or a Policy"):
    jmp.get_policy(3)
  # A preset where a policy goes: the message says which policy it holds.
  preset = jmp.get_preset("bf16-mixed")
  want = repr(preset.policy)
  with pytest.raises(TypeError, match=re.escape(f".policy: {want}")):
    jmp.get_policy(preset)
  with pytest.raises(ValueError, match=r"'bf16-mixed'.*get_preset\(name\)"):
    jmp.get_policy("bf16-mixed")
  with pytest.raises(ValueError, match=r"Unknown dtype 'bf17'"):
    jmp.get_policy("bf17")


@pytest.mark.parametrize(
  "src,dst",
  list(
    itertools.product(
      [np.float64, np.float32], [np.float16, ml_dtypes.bfloat16, np.float32]
    )
  ),
)
def test_cast_matches_numpy_rounding(src, dst, variant):
  # Values spanning normals, subnormals, overflow and ties, from float64.
  rng = np.random.default_rng(0)
  x64 = np.concatenate(
    [
      rng.standard_normal(500) * 10.0 ** rng.integers(-9, 6, 500),
      [
        0.0,
        -0.0,
        65504.0,
        65520.0,
        1e6,
        1 + 2.0**-8,
        1 + 3 * 2.0**-9,
        np.inf,
        -np.inf,
      ],
    ]
  )
  x = x64.astype(src)
  if src is np.float64:
    jax.config.update("jax_enable_x64", True)
  try:
    policy = jmp.Policy(np.float32, dst, np.float32)
    got = variant(policy.cast_to_compute)(jnp.asarray(x))
    with np.errstate(over="ignore"):
      want = x.astype(dst)  # NumPy / ml_dtypes round-to-nearest-even
    assert got.dtype == dst
    np.testing.assert_array_equal(
      np.asarray(got).view(np.uint8), want.view(np.uint8)
    )
  finally:
    jax.config.update("jax_enable_x64", False)


def test_casts_touch_only_the_floats_a_policy_names(variant):
  policy = jmp.get_policy("p=f32,c=bf16,o=f16")
  arrays = {
    "f": jnp.ones(3),
    "np_f": np.ones(3, np.float32),
    "i": jnp.arange(3),
    "b": jnp.array([True, False]),
    "u8": np.arange(3, dtype=np.uint8),
    "fp8": jnp.ones(3, jnp.float8_e4m3fn),
  }
  out = variant(policy.cast_to_compute)(arrays)
  assert out["f"].dtype == jnp.bfloat16 and out["np_f"].dtype == jnp.bfloat16
  for key in ("i", "b", "u8", "fp8"):
    assert out[key].dtype == arrays[key].dtype
    np.testing.assert_array_equal(np.asarray(out[key]), np.asarray(arrays[key]))
  # Eagerly, untouched leaves are the very same objects.
  tree = {**arrays, "py": 1.5, "none": None}
  eager = policy.cast_to_compute(tree)
  for key in ("i", "b", "u8", "fp8", "py", "none"):
    assert eager[key] is tree[key]


def test_cast_to_full_and_half_like_jmp():
  half = jmp.half_dtype()
  obj = object()
  tree = dict(
    o=obj,
    h=jnp.ones([], half),
    f=jnp.ones([]),
    i=jnp.ones([], jnp.int16),
    d=np.ones([], np.float64),
  )
  full = jmp.cast_to_full(tree)
  assert full["o"] is obj and full["i"] is tree["i"] and full["f"] is tree["f"]
  assert full["h"].dtype == jnp.float32 and full["d"].dtype == np.float32
  halved = jmp.cast_to_half(tree)
  assert halved["f"].dtype == half and halved["h"] is tree["h"]
  assert halved["i"] is tree["i"]
  assert jmp_train.cast_floating(tree, jnp.bfloat16)["f"].dtype == jnp.bfloat16


# jmp code uses a policy's dtypes as jnp scalar types.
BY_JNP_TYPE = {
  jnp.float16: "float16",
  jnp.bfloat16: "bfloat16",
  jnp.float32: "float32",
}


@pytest.mark.parametrize(
  "given,want",
  [
    (np.float16, jnp.float16),
    (np.dtype("float16"), jnp.float16),
    ("f16", jnp.float16),
    (jnp.float16, jnp.float16),
    (ml_dtypes.bfloat16, jnp.bfloat16),
    (np.dtype(jnp.bfloat16), jnp.bfloat16),
    ("bfloat16", jnp.bfloat16),
    (np.float32, jnp.float32),
    (np.dtype("float32"), jnp.float32),
    ("full", jnp.float32),
  ],
)
def test_policy_dtypes_are_jnp_scalar_types_like_jmp(given, want):
  policy = jmp.Policy(given, given, given)
  for dtype in (policy.param_dtype, policy.compute_dtype, policy.output_dtype):
    assert dtype is want
    scalar = dtype(1.5)
    assert scalar.dtype == np.dtype(want) and float(scalar) == 1.5
    # jmp code keys tables by jnp types; np.dtype("float16") would miss.
    assert BY_JNP_TYPE[dtype] == np.dtype(want).name
    assert dtype.__name__ == np.dtype(want).name
  assert jmp.get_policy(str(policy)).compute_dtype is want
  assert policy.with_output_dtype(given).output_dtype is want


@pytest.mark.parametrize(
  "bad,error,fragment",
  [
    (None, TypeError, "got None"),  # np.dtype(None) is float64
    (float, TypeError, "the builtin float"),  # float64 in NumPy, f32 in JAX
    (jnp.ones(3), TypeError, "param_dtype must be a floating dtype"),
    (
      jax.ShapeDtypeStruct((), jnp.float32),
      TypeError,
      "param_dtype must be a floating dtype",
    ),
  ],
)
def test_policy_refuses_what_is_not_a_dtype(bad, error, fragment):
  with pytest.raises(error) as err:
    jmp.Policy(bad, "f32", "f32")
  assert fragment in str(err.value) and "param_dtype" in str(err.value)
  with pytest.raises(error, match="output_dtype"):
    jmp.get_policy("f32").with_output_dtype(bad)


def test_dtype_to_names_drives_str_like_jmp():
  # jmp's test_str: each part of str(policy) is dtype_to_names[dtype][0];
  # np.float16 and jnp.float16 find the same entry.
  names = jmp.dtype_to_names
  for dtype in (np.float16, jnp.float16, jnp.bfloat16, np.float32, jnp.float32):
    policy = jmp.Policy(dtype, dtype, dtype)
    parts = [part.split("=")[1] for part in str(policy).split(",")]
    assert parts == [names[dtype][0]] * 3
    assert parts[0] == np.dtype(dtype).name  # our full names, not "full"
  for dtype, aliases in names.items():
    for alias in aliases:
      assert jmp.get_policy(alias).param_dtype is dtype
  with pytest.raises(TypeError):
    names[jnp.float16] = ("half",)  # read-only: str() and parsing rely on it


def test_cast_floating_refuses_none():
  with pytest.raises(TypeError, match="dtype is None"):
    jmp_train.cast_floating({"a": jnp.ones(2)}, None)
