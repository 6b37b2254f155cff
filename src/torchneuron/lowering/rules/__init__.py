"""torchneuron's own decompositions: a module per family of ops that
PyTorch's decompositions or torch-mlir lower wrongly, imprecisely or not at
all (special functions, division, NaN propagation, long sums and
convolutions in blocks, factorizations, ...). decompositions.py puts them in
the table applied before import; the machinery that applies them (tracing,
export, import to MLIR) is the rest of lowering/."""
