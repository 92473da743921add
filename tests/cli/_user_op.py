"""Force ops of a user, outside the package, for `run --op` tests (block convention, scalars by name).

- `morse`: a JAX Morse pair potential whose scalars have other names, and another order, than the demo's
  (two of them without defaults).
- `soft_sphere`: a torch custom op (`jaxbridge_usertest::soft_sphere`) whose defaults live in its schema.
- `unmasked_pair`: a JAX pair potential that ignores `owned_mask`, so it counts ghost-ghost pairs and its
  distributed result is not the one-device one (a parity miss, as a user's bug would give).
"""

import jax
import jax.numpy as jnp
import torch


def _pairs(positions, cutoff):
    """(safe r, inside) of all ordered pairs of the block."""
    d = positions[:, None, :] - positions[None, :, :]
    r2 = jnp.sum(d * d, axis=-1)
    inside = (r2 <= cutoff * cutoff) & ~jnp.eye(positions.shape[0], dtype=bool)
    return jnp.sqrt(jnp.where(inside, r2, 1.0)), inside


def _morse_u(r, r0, depth, alpha):
    return depth * ((1.0 - jnp.exp(-alpha * (r - r0))) ** 2 - 1.0)


def morse(positions, owned_mask, r0, depth, cutoff=6.0, alpha=1.3):
    """Morse pairs shifted to zero at the cutoff; pair weight (owned_i + owned_j) / 2."""

    def energy(x):
        r, inside = _pairs(x, cutoff)
        own = owned_mask.astype(x.dtype)
        w = jnp.where(inside, 0.5 * (own[:, None] + own[None, :]), 0.0)
        u = _morse_u(r, r0, depth, alpha) - _morse_u(cutoff, r0, depth, alpha)
        return 0.5 * jnp.sum(w * u)

    e, g = jax.value_and_grad(energy)(positions)
    return e, -g


def unmasked_pair(positions, owned_mask, cutoff=6.0, strength=0.01):
    """A smooth repulsion over every pair of the block, ghosts included (the owned_mask is ignored)."""

    def energy(x):
        r, inside = _pairs(x, cutoff)
        return 0.5 * jnp.sum(jnp.where(inside, strength * (1.0 - r / cutoff) ** 2, 0.0))

    e, g = jax.value_and_grad(energy)(positions)
    return e, -g


@torch.library.custom_op("jaxbridge_usertest::soft_sphere", mutates_args=())
def soft_sphere(positions: torch.Tensor, owned_mask: torch.Tensor, cutoff: float = 4.5,
                strength: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    """u(r) = strength (1 - r / cutoff)^2 inside the cutoff, in plain torch; forces written out."""
    d = positions[:, None, :] - positions[None, :, :]
    r2 = (d * d).sum(-1)
    inside = (r2 <= cutoff * cutoff) & ~torch.eye(positions.shape[0], dtype=torch.bool)
    r = torch.sqrt(torch.where(inside, r2, torch.ones_like(r2)))
    own = owned_mask.to(positions.dtype)
    w = torch.where(inside, 0.5 * (own[:, None] + own[None, :]), torch.zeros_like(r2))
    u = strength * (1.0 - r / cutoff) ** 2
    fscal = 2.0 * strength * (1.0 - r / cutoff) / (cutoff * r)  # -u'(r) / r
    return 0.5 * (w * u).sum(), ((w * fscal)[..., None] * d).sum(1)


@soft_sphere.register_fake
def _(positions, owned_mask, cutoff=4.5, strength=0.02):
    return positions.new_empty(()), positions.new_empty(positions.shape)


def singular_morse(positions, owned_mask, r0, depth, r_nan, cutoff=6.0, alpha=1.3):
    """`morse`, except that the energy and the forces of atoms in a pair closer than `r_nan` are NaN (a model
    whose formula breaks below a distance; the same numbers as `morse` above it)."""
    e, f = morse(positions, owned_mask, r0, depth, cutoff, alpha)
    r, inside = _pairs(positions, cutoff)
    close = jnp.any(inside & (r < r_nan), axis=1)
    return jnp.where(jnp.any(close), jnp.nan, e), jnp.where(close[:, None], jnp.nan, f)
