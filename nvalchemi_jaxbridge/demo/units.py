"""Unit system of the demo: eV, Å, amu, fs, K, e (CODATA 2018 constants)."""

#: Boltzmann constant in eV/K.
KB_EV = 8.617333262e-5
#: 1 amu·Å²/fs² expressed in eV (kinetic energy = 0.5 * MVV2E * m v²).
MVV2E = 1.66053906660e-27 * 1e10 / 1.602176634e-19
#: Coulomb constant 1/(4 pi eps0) in eV·Å/e².
COULOMB_EV_A = 1.602176634e-19 / (4.0 * 3.141592653589793 * 8.8541878128e-12) * 1e10

#: Masses (amu) and atomic numbers used by the demo systems.
MASS = {"Ar": 39.948, "Na": 22.98976928, "Cl": 35.453}
ATOMIC_NUMBER = {"Ar": 18, "Na": 11, "Cl": 17}
