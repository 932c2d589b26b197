"""A stack of identical blocks, stored with a leading ``layers`` dim and run as a scan or unrolled.

    Stack(lambda rngs: Block(..., rngs=rngs), n_layers, rngs=rngs, scan="auto")

Parameters are ``W[layers, D, F]`` either way (checkpoints restore under both forms); ``scan`` picks
a compiled loop (compile time flat in depth) or the blocks unrolled (no loop overhead), ``auto`` by
depth and backend (:func:`stack_form`, docs/performance.md); ``remat`` names what each block keeps
(:mod:`spmd.remat`). ``reorder`` stores the layers in an interleaved pipeline's chunk order
(:mod:`spmd.pipeline.order`); calling the stack still applies them in natural order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from spmd import remat as remat_lib
from spmd.pipeline.order import LayerOrder, mark, order_of

FORMS = ("auto", "scanned", "unrolled")
# auto: unrolled up to this many blocks on a backend, scanned above (docs/performance.md: on CPU the loop's
# per-iteration work is a large share of a small step; on an H100 the 16-block Llama-3.2-1B step is 1.21x
# faster and 9.5 GiB smaller unrolled, compiling in about the same time: benchmarks/RESULTS.md, gpu_train;
# compile time grows with unrolled depth everywhere)
UNROLL_UP_TO = {"cpu": 16, "gpu": 16, "tpu": 8}


def stack_form(form: str, n: int, backend: str | None = None) -> str:
    """``scanned`` or ``unrolled``: ``form`` itself, or for ``auto`` unrolled when ``n`` blocks are at
    most ``UNROLL_UP_TO[backend]`` (default backend: jax's; 8 for one not listed)."""
    if form not in FORMS:
        raise ValueError(f"layer stack form {form!r} is not one of {', '.join(FORMS)}")
    if form != "auto":
        return form
    backend = backend or jax.default_backend()
    return "unrolled" if n <= UNROLL_UP_TO.get(backend, 8) else "scanned"


class Stack(nnx.Module):
    """n identical blocks; ``stack(x, *args)`` applies them in order: ``x = block_i(x, *args)``."""

    def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module], n: int, *, rngs: nnx.Rngs,
                 remat: bool | str = False, scan: str = "auto", backend: str | None = None):
        if n < 1:
            raise ValueError(f"a stack needs at least one block, got n={n}")
        keys = jax.random.split(rngs.params(), n)

        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def create(key):
            return make_block(nnx.Rngs(params=key))

        self.block = create(keys)
        self.n, self.remat = n, remat_lib.resolve(remat)  # a policy name (spmd.remat)
        self.form = stack_form(scan, n, backend)  # "scanned" | "unrolled" (same parameters either way)

    @property
    def unroll(self) -> int:
        """``lax.scan``'s ``unroll``: 1 (a loop) when scanned; all ``n`` iterations inlined when unrolled
        (the same per-block computation with no loop; equal to the scanned form up to XLA's fusion of
        reductions, ~1e-7 relative: docs/performance.md)."""
        return self.n if self.form == "unrolled" else 1

    @property
    def order(self) -> LayerOrder:
        """The order the layers are stored in (natural unless :meth:`reorder` changed it)."""
        return order_of(self.block)

    def reorder(self, order: LayerOrder) -> None:
        """Store the layers in ``order``: every variable's ``layers`` dim is permuted (each natural
        layer keeps its values) and the order is recorded in the variables' metadata."""
        order.check(self.n)
        state = nnx.state(self.block)
        nnx.update(self.block, self.order.convert(state, order))
        mark(self.block, order)

    def split(self) -> tuple[Callable[..., Any], nnx.State]:
        """``(apply, state)``: ``state`` holds the stacked params ``[layers, ...]`` in :attr:`order`;
        ``apply(state_slice, x, *args)`` runs the blocks of any slice of it along ``layers``, in
        order (what a pipeline stage runs on its chunk of layers); like calling the stack, it returns
        ``(y, aux summed over the slice's layers)`` when the blocks return ``(x, aux)``."""
        graphdef, state = nnx.split(self.block)
        remat, form = self.remat, self.form

        def apply(layers_state: nnx.State, x: jax.Array, *args: Any) -> jax.Array | tuple[jax.Array, Any]:
            def body(carry, layer_state):
                return _carry_and_aux(nnx.merge(graphdef, layer_state)(carry, *args), carry)

            n = jax.tree.leaves(layers_state)[0].shape[0]
            unrolled = form == "unrolled"
            y, aux = jax.lax.scan(remat_lib.wrap(body, remat, loop=not unrolled), x, layers_state,
                                  unroll=n if unrolled else 1)
            return y if aux is None else (y, jax.tree.map(lambda a: a.sum(0), aux))

        return apply, state

    def __call__(self, x: jax.Array, *args: Any) -> jax.Array | tuple[jax.Array, Any]:
        """Run the blocks over ``x`` (a scan, or unrolled: :attr:`form`); variables the blocks update (batch
        statistics, RNG counts) are carried out of the scan and written back, one slice per layer. A block may return ``(x, aux)``
        (``aux`` a pytree of arrays, e.g. MoE losses): the stack then returns ``(y, aux summed over layers)``.
        Layers run in natural order: a stack stored in chunk order is put in natural order first (an
        all-to-all over ``pipe`` when it is sharded)."""
        order = self.order
        graphdef, params, rest = nnx.split(self.block, nnx.Param, ...)
        params, rest = order.to_natural((params, rest))

        def body(carry, layer):
            block = nnx.merge(graphdef, *layer)
            y, aux = _carry_and_aux(block(carry, *args), carry)
            return y, (nnx.state(block, nnx.Not(nnx.Param)), aux)

        y, (rest, aux) = jax.lax.scan(remat_lib.wrap(body, self.remat, loop=self.form == "scanned"), x, (params, rest),
                                      unroll=self.unroll)
        nnx.update(self.block, order.to_stored(rest))
        return y if aux is None else (y, jax.tree.map(lambda a: a.sum(0), aux))


def _carry_and_aux(out: Any, carry: Any) -> tuple[Any, Any]:
    """A block's ``(carry, aux)``: it returns its carry, or ``(carry, aux)``, told apart by the carry's
    structure (a carry may be a tuple); ``aux`` None for the first."""
    same: bool = jax.tree.structure(out) == jax.tree.structure(carry)  # type: ignore[operator]
    return (out, None) if same else out


def reorder_stacks(module: nnx.Module, order: LayerOrder) -> nnx.Module:
    """Store the layers of every :class:`Stack` in ``module`` in ``order``; returns ``module``."""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, Stack):
            node.reorder(order)
    return module


def stack_orders(module: nnx.Module) -> tuple[tuple[tuple[str, ...], int, LayerOrder], ...]:
    """``(path of its block's variables, n_layers, order)`` of every :class:`Stack` in ``module`` not
    stored in natural order (what a checkpoint converts: ``trainers.checkpoint.layer_order``)."""
    return tuple((tuple(str(k) for k in path) + ("block",), node.n, node.order)
                 for path, node in nnx.iter_graph(module) if isinstance(node, Stack) and not node.order.natural)
