/*
 * Web Workers for pages opened from disk: the docs site's search, with no web server and no
 * network.
 *
 * A page opened as file:// may not start a Web Worker (the browser refuses the script's
 * origin), and the site's search runs in one. mkdocs-material's offline plugin inlines the
 * search index into a script and expects an "iframe-worker" shim to stand in for `Worker`;
 * left to itself it loads one from the web (unpkg.com), which a page opened offline cannot
 * reach. This file is that stand-in, served with the site (mkdocs.yml: extra.polyfills, whose
 * "iframe-worker" name tells the plugin one is there).
 *
 * The worker's script runs in a hidden iframe of the page instead of a thread: the same
 * script, its globals in the iframe's window. `postMessage` either way is a `message` event on
 * the other side, sent after the current task and structurally cloned into the receiver's
 * realm, as between a page and a real worker. `importScripts` loads its scripts in order and
 * returns a promise (the search worker awaits it). Served over http(s) (`mkdocs serve`, a web
 * host), the browser's own `Worker` stays untouched.
 */
(function () {
  "use strict";
  if (window.location.protocol !== "file:") {
    return;
  }

  function loadScript(scope, src) {
    return new Promise(function (resolve, reject) {
      var script = scope.document.createElement("script");
      script.src = src;
      script.onload = function () { resolve(); };
      script.onerror = function () { reject(new Error("cannot load the worker script " + src)); };
      scope.document.head.appendChild(script);
    });
  }

  class IframeWorker extends EventTarget {
    constructor(url) {
      super();
      this.onmessage = null;
      this.onerror = null;
      this._pending = [];
      this._ready = false;
      var frame = document.createElement("iframe");
      frame.hidden = true;
      frame.tabIndex = -1;
      frame.setAttribute("aria-hidden", "true");
      (document.body || document.documentElement).appendChild(frame);
      this._frame = frame;
      var scope = frame.contentWindow;
      var self = this;
      var base = document.baseURI;
      // The worker's side: what it posts reaches the page's listeners.
      scope.postMessage = function (data) {
        var copy = window.structuredClone(data);
        window.setTimeout(function () { self._emit("message", copy); }, 0);
      };
      scope.importScripts = function () {
        var urls = Array.prototype.map.call(arguments, function (u) { return new URL(u, base).href; });
        return urls.reduce(function (done, u) {
          return done.then(function () { return loadScript(scope, u); });
        }, Promise.resolve());
      };
      loadScript(scope, new URL(url, base).href).then(function () {
        self._ready = true;
        self._pending.splice(0).forEach(function (data) { self._send(data); });
      }, function (error) {
        self._emit("error", error);
      });
    }

    postMessage(data) {
      if (this._ready) {
        this._send(data);
      } else {
        this._pending.push(data);
      }
    }

    terminate() {
      this._frame.remove();
      this._pending = [];
    }

    _send(data) {
      var scope = this._frame.contentWindow;
      if (!scope) {
        return;  // terminated
      }
      var copy = scope.structuredClone(data);
      window.setTimeout(function () {
        scope.dispatchEvent(new scope.MessageEvent("message", { data: copy }));
      }, 0);
    }

    _emit(type, payload) {
      var event = type === "message"
        ? new MessageEvent("message", { data: payload })
        : new ErrorEvent("error", { error: payload, message: String(payload) });
      var handler = type === "message" ? this.onmessage : this.onerror;
      if (typeof handler === "function") {
        handler.call(this, event);
      }
      this.dispatchEvent(event);
    }
  }

  // The search worker looks for this name to know it runs in a frame of the page, and then finds
  // its lunr language files next to its own script (a site in English needs none).
  window.IFrameWorker = IframeWorker;
  window.Worker = IframeWorker;
})();
