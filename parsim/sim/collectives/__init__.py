"""Collective communication: algorithms as phases of flows, simulated on the network."""

from .algorithms import ALGORITHMS, Phase, applicable_algorithms, build_phases
from .simulate import CollectivePrediction, predict, simulate_phases

__all__ = ["ALGORITHMS", "Phase", "applicable_algorithms", "build_phases", "CollectivePrediction",
           "predict", "simulate_phases"]
