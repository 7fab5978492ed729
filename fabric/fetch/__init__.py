"""Weights from peers: a node without the model file fetches its layers from the nodes that
hold them (``meshnet pull MODEL --tracker T``, ``meshnet node --model MODEL --tracker T``)."""
