"""The Nemotron-H family."""
