"""Operators of the compact execution: KDA linear attention (`harts.ops.kda`) and attention groups
(`harts.ops.attention`). Each has a plain reference next to its fast path; see their READMEs."""
