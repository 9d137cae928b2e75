"""Produces records with confluent-kafka's own AvroSerializer or
ProtobufSerializer, the bytes a real upstream's client writes (Confluent
wire format, schema registered in the registry under <topic>-value). The
tests run it with the venv that `scripts/stack install` makes
(install_python_producers).

  produce_registry.py avro BROKERS REGISTRY_URL TOPIC SCHEMA_FILE < records.jsonl
  produce_registry.py protobuf BROKERS REGISTRY_URL TOPIC DESCRIPTOR_SET MESSAGE < records.jsonl

Each input line is one record as JSON. With --envelope first, each line is
{"key": TEXT or null, "headers": [[NAME, VALUE], ...], "value": RECORD}
and the output is each record's "PARTITION OFFSET", one a line, in input
order (the chaos suite's recount needs where every record landed).

Avro: strings of the fields named in the schema as Avro decimals become
decimal.Decimal (exact), as an upstream's own values would be.

Protobuf: DESCRIPTOR_SET is a serialized FileDescriptorSet of the .proto
file and its imports (what `protoc --include_imports
--descriptor_set_out` writes; the test kit compiles it with protox, as no
protoc is installed here); MESSAGE the full name of the message to write.
Each record is read by the proto3 JSON mapping (json_format.ParseDict), so
a Timestamp is given as RFC 3339 text, and the message class is made from
the descriptor the way generated code makes it. The serializer registers
the file as it does for generated code (its FileDescriptorProto, base64,
well-known imports not referenced) and writes the message indexes.
"""
import decimal
import json
import sys

from confluent_kafka import Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.serialization import MessageField, SerializationContext


def decimal_fields(schema):
    names = set()
    for f in schema.get("fields", []):
        t = f["type"]
        branches = t if isinstance(t, list) else [t]
        for b in branches:
            if isinstance(b, dict) and b.get("logicalType") == "decimal":
                names.add(f["name"])
    return names


def avro_serializer(client, schema_file):
    from confluent_kafka.schema_registry.avro import AvroSerializer

    schema_str = open(schema_file).read()
    decimals = decimal_fields(json.loads(schema_str))
    serializer = AvroSerializer(client, schema_str, lambda obj, ctx: obj)

    def serialize(record, ctx):
        for name in decimals:
            if isinstance(record.get(name), str):
                record[name] = decimal.Decimal(record[name])
        return serializer(record, ctx)

    return serialize


def protobuf_serializer(client, descriptor_set, message):
    from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
    from confluent_kafka.schema_registry.protobuf import ProtobufSerializer

    files = descriptor_pb2.FileDescriptorSet()
    files.ParseFromString(open(descriptor_set, "rb").read())
    pool = descriptor_pool.DescriptorPool()
    # Imports first, as protoc and protox write them.
    for f in files.file:
        pool.Add(f)
    cls = message_factory.GetMessageClass(pool.FindMessageTypeByName(message))
    serializer = ProtobufSerializer(cls, client, {"use.deprecated.format": False})
    return lambda record, ctx: serializer(json_format.ParseDict(record, cls()), ctx)


def main():
    envelope = sys.argv[1] == "--envelope"
    if envelope:
        del sys.argv[1]
    kind, brokers, registry, topic = sys.argv[1:5]
    client = SchemaRegistryClient({"url": registry})
    if kind == "avro":
        serialize = avro_serializer(client, sys.argv[5])
    elif kind == "protobuf":
        serialize = protobuf_serializer(client, sys.argv[5], sys.argv[6])
    else:
        sys.exit(f"unknown format {kind!r}: avro or protobuf")
    producer = Producer({"bootstrap.servers": brokers, "enable.idempotence": True})
    ctx = SerializationContext(topic, MessageField.VALUE)
    placed = []
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        if envelope:
            env = json.loads(line)
            key, headers, record = env.get("key"), env.get("headers", []), env["value"]
        else:
            key, headers, record = None, [], json.loads(line)
        placed.append(None)
        produce(producer, topic, key, headers, serialize(record, ctx), placed, len(placed) - 1)
    if producer.flush(60) != 0:
        sys.exit("not every record was acknowledged")
    if envelope:
        if any(p is None or isinstance(p, str) for p in placed):
            sys.exit(f"a record was not delivered: {[p for p in placed if isinstance(p, str)][:3]}")
        sys.stdout.write("".join(f"{p} {o}\n" for p, o in placed))
    else:
        print(len(placed))


def produce(producer, topic, key, headers, value, placed, i):
    def delivered(err, msg):
        placed[i] = str(err) if err else (msg.partition(), msg.offset())

    while True:
        try:
            producer.produce(topic, key=key, value=value, headers=[tuple(h) for h in headers],
                             on_delivery=delivered)
            break
        except BufferError:
            # The local queue is full (a large chunk): let deliveries drain.
            producer.poll(0.1)
    producer.poll(0)


if __name__ == "__main__":
    main()
