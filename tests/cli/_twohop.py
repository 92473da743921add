"""A two-hop JAX kernel for `validate` tests: energy = sum over owned i of sum_j f(r_ij) c_j, c_j = sum_k f(r_jk)."""

import jax.numpy as jnp


def two_hop(positions, owned_mask, cutoff=4.5):
    """Block energy of a kernel that reads neighbours of neighbours (needs a ghost width of 2 x cutoff)."""
    d = positions[:, None, :] - positions[None, :, :]
    r2 = jnp.sum(d * d, axis=-1)
    inside = (r2 < cutoff * cutoff) & ~jnp.eye(positions.shape[0], dtype=bool)
    f = jnp.where(inside, (1.0 - r2 / (cutoff * cutoff)) ** 2, 0.0)
    c = jnp.sum(f, axis=1)
    return (jnp.sum(owned_mask.astype(positions.dtype) * (f @ c)),)
