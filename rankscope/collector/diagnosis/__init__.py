"""Diagnosis: detectors that name the rank and host behind stragglers, hangs, crashes, NaNs and slow links.

The same code runs live in the collector and offline (``rankscope diagnose --run RUN``); every
detector reads the store through SQL only, so it needs no collector memory.
"""
