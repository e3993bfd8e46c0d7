"""The engine: building a model from a store, generation, sequence state and caches."""
