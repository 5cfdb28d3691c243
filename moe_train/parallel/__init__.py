"""Meshes, tensor/sequence/expert/pipeline/data parallel plans and recompute policies."""
