"""The layers kiln models are built from. Each layer owns its sharding and weight loading."""
