"""Experiments that answer research questions with kvlife's components."""
