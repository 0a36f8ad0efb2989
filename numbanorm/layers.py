"""Stateful layers for NumPy training loops.

``layer(x)`` runs the forward and keeps what the backward needs;
``layer.backward(dy)`` returns ``dx`` and sets ``grad_weight``/``grad_bias``;
``layer.eval()`` keeps nothing (a forward for inference, without a copy of x).

One class per norm (its constructor is what a user writes); the forward and
backward come from the table's row: the layer's attributes carry the role names
(``normalized_shape`` or ``num_groups``, ``weight``, ``bias``, ``eps``).
"""

import threading

import numpy as np

from . import _dispatch
from . import _validate as V
from .operations import BY_NAME


def _saved(a):
    """A private copy of ``a`` (the input, the weight) for the backward: the caller may reuse
    its buffer or update the weight in place between forward and backward (NumPy has no
    version counters to notice it)."""
    return None if a is None else _dispatch._pick(a=a).copy(a)


def _shape(normalized_shape):
    """A layer's ``normalized_shape`` as a tuple, refused where a dimension is negative (the
    parameters' arrays could not be made; a zero-sized one is refused by the call)."""
    shape = V._as_shape(normalized_shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"`normalized_shape` must have no negative dimension, got {shape}")
    return shape


def _eps(eps, dtype, allow_none=False):
    """``eps`` checked in the accumulation dtype of the layer's parameters, kept as given:
    rounded to float32 it would differ from the functional call's for float64 inputs."""
    V.check_eps(eps, dtype, allow_none=allow_none)
    return V.real_eps(eps, allow_none=allow_none)


class _Norm:
    _op = None  # the table's row of the layer's operation
    training = True  # (torch.nn's name: a forward keeps what a backward needs)

    def train(self, mode=True):
        """Set ``training`` (a forward keeps copies of x and the weight for its backward,
        or, False, nothing); returns the layer."""
        self.training = bool(mode)
        return self

    def eval(self):
        """``train(False)``: forwards for inference, which keep nothing and copy nothing."""
        return self.train(False)

    def __getstate__(self):
        # the last input is not part of a layer: a pickle carries the parameters only
        state = self.__dict__.copy()
        state.pop("_forwards", None)
        return state

    def _thread(self):
        """This thread's record of the layer's last forward (``saved``: private copies of x and
        the weight, the statistics), which its backward takes: a layer shared by threads pairs
        each backward with its own thread's forward, as autograd's graph of each call would."""
        forwards = self.__dict__.get("_forwards")
        if forwards is None:
            forwards = self.__dict__.setdefault("_forwards", threading.local())  # (one, under a race)
        return forwards

    def _check_input(self, x):
        """A layer's own check of x before the forward (the function checks the rest)."""

    def __call__(self, x):
        """The forward: y, keeping copies of ``x`` and the weight and the statistics for this
        thread's ``backward`` (in ``training`` mode; otherwise nothing).

        Parameters
        ----------
        x : array
            The input (NumPy, or a CUDA array with the parameters on the device too).

        Returns
        -------
        y : array
            The normalized ``x``: its shape and dtype.

        Raises
        ------
        TypeError
            ``x`` of another dtype than float16, float32, float64 and bfloat16; ``x`` and
            the parameters on different sides (host, device).
        ValueError
            ``x`` whose trailing dimensions (channels) do not fit the layer.
        """
        last = self._thread()
        last.saved = None  # (a forward that fails leaves no backward of an earlier one)
        self._check_input(x)
        op = self._op
        given = {"x": x, **{r: getattr(self, r) for r in op.forward_roles[1:]}}
        if not self.training:
            return op.call(_dispatch, "plain", given)
        made = dict(zip(op.forward_outputs, op.call(_dispatch, "forward", given)))
        last.saved = (_saved(x), _saved(given["weight"]), given.get("bias") is not None,
                      *(made[r] for r in op.stats))
        return made["y"]

    def backward(self, dy):
        """The backward of this thread's last forward, which it takes (a second backward
        needs a forward of its own): dx, with ``grad_weight`` and ``grad_bias`` set (from
        the weight as that forward read it; the layer's, so the last backward of any
        thread sets them).

        Parameters
        ----------
        dy : array
            The gradient of the loss with respect to the last forward's y: its shape.

        Returns
        -------
        dx : array
            The gradient with respect to the last forward's x: its shape and dtype.

        Raises
        ------
        TypeError
            ``dy`` of another dtype than float16, float32, float64 and bfloat16, or on
            another side than x.
        ValueError
            ``dy`` not of x's shape.
        RuntimeError
            No forward in training mode before it in this thread, or one that an
            earlier backward took.
        """
        last = self._thread()
        saved = getattr(last, "saved", None)
        if saved is None:
            raise RuntimeError(f"{type(self).__name__}.backward called before a forward (in this thread, in "
                               "training mode; each forward takes one backward)")
        op = self._op
        x, weight, biased, *stats = saved
        values = {"dy": dy, "x": x, **dict(zip(op.stats, stats)),
                  "normalized_shape": getattr(self, "normalized_shape", None), "weight": weight}
        dx, *dparams = op.call(_dispatch, "backward", values)
        last.saved = None  # (taken: the copy of x is freed, and a second backward refused)
        grads = dict(zip(op.params, dparams))
        self.grad_weight = grads["weight"] if weight is not None else None
        self.grad_bias = grads.get("bias") if biased else None
        return dx

    def __repr__(self):
        return f"{type(self).__name__}({self.extra_repr()})"


_ATTRIBUTES = """
    Attributes
    ----------
    weight : array or None
        The scale (ones at first), None without it; assign an array of its shape to change it.
    bias : array or None
        The shift (zeros at first), None without it.
    grad_weight : array or None
        The gradient of ``weight`` that the last ``backward`` set (None without a weight).
    grad_bias : array or None
        The gradient of ``bias``, as ``grad_weight``.
    training : bool
        Whether a forward keeps what a backward needs (True at first; ``eval()``,
        ``train()`` set it)."""

_DTYPE = """    dtype : dtype
        The parameters' dtype: float32 (the default, and None's), float16, float64 or
        bfloat16; the input may be of another.
"""


class LayerNorm(_Norm):
    __doc__ = """LayerNorm over the trailing ``normalized_shape`` dimensions, for NumPy training
    loops: ``layer(x)`` is ``numbanorm.layer_norm(x, normalized_shape, weight, bias, eps)``
    and keeps what ``layer.backward(dy)`` needs (copies of x and the weight, the statistics).

    Parameters
    ----------
    normalized_shape : int or tuple of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    eps : float
        Added to the variance before its square root.
    elementwise_affine : bool
        A weight and a bias of shape ``normalized_shape``.
    bias : bool
        With ``elementwise_affine``, whether there is a bias.
""" + _DTYPE + _ATTRIBUTES
    _op = BY_NAME["layer_norm"]

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, dtype=np.float32):
        self.normalized_shape = _shape(normalized_shape)
        dtype = V.layer_dtype(dtype)
        self.eps = _eps(eps, dtype)
        self.elementwise_affine = elementwise_affine
        self.weight = np.ones(self.normalized_shape, dtype) if elementwise_affine else None
        self.bias = np.zeros(self.normalized_shape, dtype) if elementwise_affine and bias else None
        self.grad_weight = self.grad_bias = None

    def extra_repr(self):
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"bias={self.bias is not None}")


class RMSNorm(_Norm):
    __doc__ = """RMSNorm over the trailing ``normalized_shape`` dimensions, for NumPy training
    loops: ``layer(x)`` is ``numbanorm.rms_norm(x, normalized_shape, weight, eps)`` and keeps
    what ``layer.backward(dy)`` needs.

    Parameters
    ----------
    normalized_shape : int or tuple of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    eps : float or None
        Added to the mean square; None: the machine epsilon of the accumulation dtype.
    elementwise_affine : bool
        A weight of shape ``normalized_shape`` (RMSNorm has no bias: ``bias`` is None).
""" + _DTYPE + _ATTRIBUTES
    _op = BY_NAME["rms_norm"]

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, dtype=np.float32):
        self.bias = None  # (an instance's, as the other layers': a class attribute was documented twice)
        self.normalized_shape = _shape(normalized_shape)
        dtype = V.layer_dtype(dtype)
        self.eps = _eps(eps, dtype, allow_none=True)
        self.elementwise_affine = elementwise_affine
        self.weight = np.ones(self.normalized_shape, dtype) if elementwise_affine else None
        self.grad_weight = self.grad_bias = None

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class GroupNorm(_Norm):
    __doc__ = """GroupNorm of ``x`` of shape ``(N, num_channels, *spatial)`` in ``num_groups``
    groups of channels, for NumPy training loops: ``layer(x)`` is ``numbanorm.group_norm(x,
    num_groups, weight, bias, eps)`` and keeps what ``layer.backward(dy)`` needs.
    ``num_groups == num_channels`` is InstanceNorm.

    Parameters
    ----------
    num_groups : int
        Groups of channels, each normalized together; a positive divisor of
        ``num_channels``.
    num_channels : int
        The channels of ``x`` (its second dimension).
    eps : float
        Added to the variance before its square root.
    affine : bool
        A weight and a bias of shape ``(num_channels,)``.
""" + _DTYPE + """    bias : bool
        With ``affine``, whether there is a bias (keyword only, as in PyTorch).
""" + _ATTRIBUTES
    _op = BY_NAME["group_norm"]

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, dtype=np.float32, *, bias=True):
        num_groups = V.integer("num_groups", num_groups)
        num_channels = V.integer("num_channels", num_channels)
        if num_groups <= 0 or num_channels <= 0 or num_channels % num_groups:
            raise ValueError(f"num_groups={num_groups} must be positive and divide num_channels={num_channels}")
        self.num_groups = num_groups
        self.num_channels = num_channels
        dtype = V.layer_dtype(dtype)
        self.eps = _eps(eps, dtype)
        self.affine = affine
        self.weight = np.ones(num_channels, dtype) if affine else None
        self.bias = np.zeros(num_channels, dtype) if affine and bias else None
        self.grad_weight = self.grad_bias = None

    def _check_input(self, x):
        if len(np.shape(x)) < 2 or np.shape(x)[1] != self.num_channels:
            raise ValueError(f"expected x of shape (N, {self.num_channels}, *spatial), got {tuple(np.shape(x))}")

    def extra_repr(self):
        return (f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}, "
                f"bias={self.bias is not None}")
