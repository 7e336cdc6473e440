#!/usr/bin/env node
// echo.js: the echo server and client of the runtime conformance suite on Node.js `net`
// (one event loop, libuv on epoll), written as Node programs usually are: callbacks, streams
// with backpressure (write() === false -> pause until 'drain').
//
//   node echo.js server --port-file F [--host H] [--deadline S]
//   node echo.js client --host H --port P --test echo|rr|many [--count N] [--conns N] [--bytes N]
//
// Protocol (tests/runtimes/README.md): a connection's first byte is its command. 'E': the
// server echoes every following byte until the client's EOF, then ends its side. 'Q': the
// server stops listening and exits once its connections are done, printing "OK server ...".
// The client prints "OK client <test>" when every reply matched byte for byte; anything else
// prints FAIL and exits non-zero. A timer is the watchdog (exit 3 at the deadline).
'use strict';
const net = require('net');
const fs = require('fs');

const ECHO_SIZES = [1, 2, 7, 100, 1000, 1460, 4096, 65535, 65536, 100003, 262144, 1 << 20];

function parse() {
  const a = {
    role: process.argv[2], host: '127.0.0.1', port: 0, portFile: null, test: 'echo',
    count: 2000, conns: 50, bytes: 256 << 10, deadline: 40,
  };
  const names = {
    '--host': 'host', '--port': 'port', '--port-file': 'portFile', '--test': 'test',
    '--count': 'count', '--conns': 'conns', '--bytes': 'bytes', '--deadline': 'deadline',
  };
  const argv = process.argv.slice(3);
  for (let i = 0; i + 1 < argv.length; i += 2) {
    const k = names[argv[i]];
    if (!k) throw new Error(`unknown option ${argv[i]}`);
    a[k] = ['host', 'portFile', 'test'].includes(k) ? argv[i + 1] : Number(argv[i + 1]);
  }
  return a;
}

const a = parse();
const errors = [];
const fail = (what) => errors.push(what);
const finish = (okMsg) => {
  if (errors.length) {
    console.log(`FAIL ${a.role}: ${errors.slice(0, 5).join('; ')} (${errors.length} error(s))`);
    process.exit(1);
  }
  console.log(`OK ${okMsg}`);
  process.exit(0);
};
setTimeout(() => {
  console.log(`FAIL ${a.role}: watchdog: still running after ${a.deadline} s`);
  process.exit(3);
}, a.deadline * 1000).unref();

// ---- server -------------------------------------------------------------------------------

function server() {
  let conns = 0; let bytes = 0; let active = 0; let quitting = false;
  const srv = net.createServer({ allowHalfOpen: true }, (sock) => {
    conns++; active++;
    sock.setNoDelay(true);
    const peer = `${sock.remoteAddress}:${sock.remotePort}`;
    let cmd = null;
    sock.on('data', (chunk) => {
      if (cmd === null) {
        cmd = chunk[0];
        chunk = chunk.subarray(1);
        if (cmd === 0x51 /* Q */) {
          quitting = true;
          srv.close();
          sock.destroy();
          return;
        }
        if (cmd !== 0x45 /* E */) {
          fail(`${peer}: unknown command byte ${cmd}`);
          sock.destroy();
          return;
        }
      }
      if (chunk.length === 0) return;
      bytes += chunk.length;
      if (!sock.write(chunk)) {
        sock.pause();
        sock.once('drain', () => sock.resume());
      }
    });
    sock.on('end', () => {
      if (cmd === null) fail(`${peer}: EOF before the command byte`);
      sock.end();
    });
    sock.on('error', (e) => fail(`${peer}: ${e.code || e.message}`));
    sock.on('close', () => {
      active--;
      if (quitting && active === 0) finish(`server conns=${conns} bytes=${bytes}`);
    });
  });
  srv.on('error', (e) => { fail(`listen: ${e.message}`); finish(''); });
  srv.listen({ host: a.host, port: 0, backlog: 512 }, () => {
    const tmp = `${a.portFile}.tmp`;
    fs.writeFileSync(tmp, `${srv.address().port}\n`);
    fs.renameSync(tmp, a.portFile);
  });
}

// ---- client -------------------------------------------------------------------------------

// Deterministic bytes of message k on connection c (xorshift32).
function pattern(c, k, n) {
  const b = Buffer.allocUnsafe(n);
  let x = ((c + 1) * 0x9e3779b9 ^ (k + 1) * 0x85ebca6b) >>> 0 || 1;
  for (let i = 0; i < n; i++) {
    x ^= x << 13; x >>>= 0;
    x ^= x >>> 17;
    x ^= x << 5; x >>>= 0;
    b[i] = x & 0xff;
  }
  return b;
}

// One echo connection: each message is written while its reply is read; the reply must equal
// it; then a half-close, and the server's EOF must follow with nothing before it.
function exchange(c, sizes, done) {
  const sock = net.connect({ host: a.host, port: a.port });
  let k = 0; let msg = null; let got = []; let gotLen = 0; let ended = false; let over = false;
  const bad = (why) => {
    if (over) return;
    over = true;
    fail(`connection ${c}: ${why}`);
    sock.destroy();
    done();
  };
  const next = () => {
    if (k === sizes.length) {
      ended = true;
      sock.end();
      return;
    }
    msg = pattern(c, k, sizes[k]);
    got = []; gotLen = 0;
    sock.write(msg);
  };
  sock.on('connect', () => {
    sock.setNoDelay(true);
    sock.write('E');
    next();
  });
  sock.on('data', (chunk) => {
    if (ended) return bad(`${chunk.length} unexpected byte(s) after the last reply`);
    got.push(chunk); gotLen += chunk.length;
    if (gotLen > msg.length) return bad(`message ${k}: ${gotLen} byte(s) back for ${msg.length}`);
    if (gotLen < msg.length) return;
    const reply = Buffer.concat(got, gotLen);
    if (!reply.equals(msg)) {
      let at = 0;
      while (reply[at] === msg[at]) at++;
      return bad(`message ${k} (${msg.length} B): reply differs from byte ${at} on`);
    }
    k++;
    next();
  });
  sock.on('end', () => {
    if (!ended) return bad(`EOF in message ${k} after ${gotLen} byte(s)`);
  });
  const where = () => (ended ? 'after the last reply (waiting for EOF)'
    : `in message ${k} of ${sizes.length} after ${gotLen} of ${msg ? msg.length : 0} B`);
  sock.on('error', (e) => bad(`${e.code || e.message} ${where()}`));
  sock.on('close', () => {
    if (!over) { over = true; done(); }
  });
}

function quitServer(then) {
  const sock = net.connect({ host: a.host, port: a.port }, () => sock.write('Q'));
  const t = setTimeout(() => { fail('quit: no EOF within 10 s'); sock.destroy(); }, 10000);
  sock.on('data', (d) => fail(`quit: ${d.length} unexpected byte(s)`));
  sock.on('error', (e) => fail(`quit: ${e.code || e.message}`));
  sock.on('close', () => { clearTimeout(t); then(); });
}

function client() {
  let plan;
  if (a.test === 'echo') plan = [ECHO_SIZES];
  else if (a.test === 'rr') plan = [Array.from({ length: a.count }, (_, i) => 1 + (i * 7) % 64)];
  else if (a.test === 'many') plan = Array.from({ length: a.conns }, () => [a.bytes]);
  else { fail(`unknown test ${a.test}`); finish(''); }
  let left = plan.length;
  plan.forEach((sizes, c) => exchange(c, sizes, () => {
    if (--left === 0) quitServer(() => finish(`client ${a.test}`));
  }));
}

if (a.role === 'server') server();
else if (a.role === 'client') client();
else { fail(`unknown role ${a.role}`); finish(''); }
