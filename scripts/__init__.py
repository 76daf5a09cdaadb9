"""Tools around minilade that are not part of the library; run them from the repository root as modules."""
