"""Routing traces and, later, the predictor heads that forecast expert use two layers ahead (paper IV-E)."""
