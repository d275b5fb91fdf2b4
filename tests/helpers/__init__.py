"""Test helpers: tiny checkpoints written by transformers, and a minimal model driver."""
