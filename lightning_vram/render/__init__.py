"""Rendering: text and Markdown, HTML with figures, the console table, TensorBoard, scalars, files."""
