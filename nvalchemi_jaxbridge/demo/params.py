"""Default parameters of the demo potentials (frozen, numpy-free, jax-free)."""

import dataclasses

from .units import COULOMB_EV_A


def _check_positive(owner: str, zero_ok: tuple[str, ...] = (), **values: float) -> None:
    """Raise if a named parameter is not a positive (or, if listed in zero_ok, zero) finite number."""
    for name, v in values.items():
        low_ok = isinstance(v, (int, float)) and (float(v) > 0.0 or (name in zero_ok and v == 0))
        if not low_ok or not float(v) < float("inf"):
            kind = "non-negative" if name in zero_ok else "positive"
            raise ValueError(
                f"{owner}: {name} must be a {kind} finite number, got {v!r}; "
                f"pass e.g. {owner}({name}=1.0)."
            )


@dataclasses.dataclass(frozen=True)
class LJParams:
    """Lennard-Jones parameters (eV, Å); defaults are argon, cutoff 2.5 sigma."""

    epsilon: float = 0.0104
    sigma: float = 3.40
    cutoff: float = 8.5

    def __post_init__(self):
        _check_positive("LJParams", epsilon=self.epsilon, sigma=self.sigma, cutoff=self.cutoff)

    def args(self) -> tuple[float, float, float]:
        """Scalar arguments in op order: (epsilon, sigma, cutoff)."""
        return (float(self.epsilon), float(self.sigma), float(self.cutoff))


@dataclasses.dataclass(frozen=True)
class DSFParams:
    """Damped shifted force Coulomb plus Born-Mayer repulsion (eV, Å, e).

    Defaults put the NaCl rock-salt energy minimum near a = 5.64 Å (DSF with
    these alpha and cutoff recovers the Madelung energy to 0.3 %).
    """

    alpha: float = 0.25
    cutoff: float = 9.0
    born_a: float = 1120.0
    born_rho: float = 0.317
    coulomb_constant: float = COULOMB_EV_A

    def __post_init__(self):
        _check_positive(
            "DSFParams",
            ("alpha",),
            alpha=self.alpha,
            cutoff=self.cutoff,
            born_a=self.born_a,
            born_rho=self.born_rho,
            coulomb_constant=self.coulomb_constant,
        )

    def args(self) -> tuple[float, float, float, float, float]:
        """Scalar arguments in op order: (alpha, cutoff, born_a, born_rho, coulomb_constant)."""
        return (
            float(self.alpha),
            float(self.cutoff),
            float(self.born_a),
            float(self.born_rho),
            float(self.coulomb_constant),
        )
