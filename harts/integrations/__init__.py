"""HARTS inside other RL trainers: each module adapts one trainer and imports it only there."""
