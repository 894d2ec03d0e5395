"""Operators: differentiable collectives (``comm``), Gated DeltaNet (``gdn``), attention."""
