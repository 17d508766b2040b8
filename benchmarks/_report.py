"""What the benchmark scripts share for printing: output to the terminal and to a
results file at once."""


class Tee:
    """A text stream that writes (and flushes) to several streams."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
            s.flush()

    def flush(self):
        for s in self.streams:
            s.flush()
