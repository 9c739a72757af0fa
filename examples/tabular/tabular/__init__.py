"""tabular: a BatchNorm MLP on a data set bundled with scikit-learn, trained with distsgd
(see the example's README.md)."""
