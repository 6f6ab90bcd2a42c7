"""Test doubles for what needs CUDA; everything that runs on a CPU is tested for real."""
