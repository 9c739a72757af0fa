"""charlm: a character-level LSTM language model on a text file that ships with the OS,
trained with distsgd (see the example's README.md)."""
