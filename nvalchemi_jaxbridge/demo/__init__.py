"""Demo physics: test systems, pair potentials (JAX, torch, Triton), numpy references, MD.

Units throughout: energy eV, length Å, mass amu, time fs, temperature K, charge e.
Importing this package (and ``systems``, ``params``, ``units``, ``reference``)
imports neither jax nor torch; ``jax_potentials`` and ``md`` import jax,
``torch_ops`` imports torch (and Triton) and registers the ``jaxbridge_demo::`` ops.
"""

from .params import DSFParams as DSFParams
from .params import LJParams as LJParams
from .systems import System as System
from .systems import argon_fcc as argon_fcc
from .systems import maxwell_boltzmann as maxwell_boltzmann
from .systems import read_structure as read_structure
from .systems import rock_salt as rock_salt
