"""YAML recipes: which variants of a model to make (stages) and how to measure them."""
